"""The engine: runs validated steps over the sequence table, the cache and the model, through the backend's runner.
Step = plan, run, sample."""

import threading
import time
from dataclasses import dataclass
from typing import Callable

import structlog

from metrale.runtime.backend.runner import Runner
from metrale.runtime.beam.call import BeamCall, BeamResult
from metrale.runtime.beam.params import BeamRequest
from metrale.runtime.cache.blocks import BlockPool, tail_split
from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.cache.prefix import PrefixCounts, cached_of
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import Cancelled, DeviceFault, FailedPrecondition, StepFailed, UnknownSequence, WorkerError, \
    describe
from metrale.runtime.forks import ForkResult, check_fork, fork
from metrale.runtime.forwards import Forwards
from metrale.runtime.planner import Limits, Plan, plan_step, rows_returning_logits
from metrale.runtime.reservation import ReleaseResult, Reservations
from metrale.runtime.run_ahead import Ahead, GuessOutput, Guesses, RunAheadCounts
from metrale.runtime.sampling import SampleRow
from metrale.runtime.rounds import Rounds, outputs_of
from metrale.runtime.sequence import SequenceTable
from metrale.runtime.step import Step, StepOutput

log = structlog.get_logger()


@dataclass(frozen=True)
class EngineStats:
    num_kv_blocks: int
    free_kv_blocks: int
    live_sequences: int
    # Blocks only the prefix cache holds (counted in free_kv_blocks).
    cached_kv_blocks: int = 0


class Engine:
    """Owns all model state. Steps on disjoint sequences may run on several streams at once: planning and
    committing hold the state lock; the forward itself does not."""

    def __init__(self, model, runner: Runner, cache: CacheManager, config: EngineConfig, max_model_len: int):
        self.model = model
        self.runner = runner
        self.cache = cache
        self.config = config
        self.sequences = SequenceTable()
        # What the prefix cache's chains start from beside a prompt's salt: the model.
        self.reservations = Reservations(self.sequences, cache, getattr(model.config, "architecture", ""))
        encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
        self.limits = Limits(max_model_len, config.max_batch_tokens, config.kv_block_size, config.max_seqs,
                             model.config.decoder_start_token_id if encoder_decoder else None,
                             # a source's cross-attention K/V take blocks as a sequence's self-attention K/V do
                             min(model.config.max_position_embeddings, max_model_len) if encoder_decoder else 0,
                             splits_at_tail=cache.has_state, snapshots=cache.states.max_snapshots > 0)
        self.forwards = Forwards(model, runner, cache, config.kv_block_size)
        self._lock = threading.Lock()
        self.rounds = Rounds(self.sequences, cache, self.forwards, runner, self.limits, config.kv_block_size,
                             encoder_decoder, self._lock)
        self.runs_ahead = config.run_ahead == "on" or (config.run_ahead == "auto" and runner.runs_ahead_by_default)
        self.guesses = Guesses(self._lock, self.sequences, cache, self.reservations, self.limits)

    def step(self, step: Step, cancelled: Callable[[], bool] = lambda: False, run_ahead: bool = False,
             reply: Callable[[StepOutput], object] | None = None) -> StepOutput:
        """Runs the step, or changes nothing: on any error, or if cancelled() before its last commit.
        reply(output): the answer built from the outputs (output.reply) before the step counts as done; if it
        raises (an answer too large to send, a bug), the step is undone too.
        run_ahead: where the engine runs ahead (run_ahead.py), the output carries the guessed next step, which the
        caller must run or skip (run_ahead.StreamPacer) before its next step. Where the step takes a guess whose
        successor is reserved and the runner queues work, the successor's device work is queued first, and the
        answer built while it runs."""
        taken = self.guesses.settle(step.seq_ids, step, cancelled)
        successor = None
        if taken is not None:
            successor = self._take_successor(taken, run_ahead)
            output, undo = taken.output, (taken.snapshot, taken.plan)
        else:
            output, undo = self._run(step, cancelled)
        if reply is not None:
            self._reply_or_undo(output, reply, cancelled, undo, successor)
        try:
            with self._lock:
                self.reservations.commit(*undo)
                self.sequences.touch(step.seq_ids, time.monotonic())
        except Exception as error:      # a bug: no queued successor may be left unwaited for
            self._abandon(successor)
            raise self._failure(error, "committing the step") from error
        if run_ahead and self.runs_ahead:
            output.ahead = successor or self._guess_next(step, output)
        return output

    def _take_successor(self, taken: Ahead, run_ahead: bool) -> Ahead | None:
        """The taken guess's successor (settle made it the sequences' guess), its device work queued where the runner
        queues work (else the stream runs it after the answer, as any guess); None where there is none, or where the
        caller does not run ahead (it is then undone)."""
        successor, taken.next = taken.next, None
        if successor is None:
            return None
        if not (run_ahead and self.runs_ahead):
            self.guesses.abandon(successor)
            return None
        if not self.runner.queues_work:
            return successor
        try:
            successor.launched = self.rounds.launch(successor.plan.rounds[0], lambda: False, successor.staged,
                                                    successor.tokens)
        except Exception:
            log.exception("run_ahead_failed")
            self._abandon(successor)
            return None
        return successor

    def _abandon(self, successor: Ahead | None) -> None:
        """Undoes a taken guess's successor, its queued device work waited for first."""
        if successor is not None:
            self._quiesce()
            self.guesses.abandon(successor)

    def _reply_or_undo(self, output: StepOutput, reply: Callable[[StepOutput], object],
                       cancelled: Callable[[], bool], undo: tuple[dict, Plan], successor: Ahead | None) -> None:
        """output.reply = reply(output); the step undone where that fails, or where the call was cancelled
        meanwhile (its answer would be lost): its queued successor first."""
        try:
            output.reply = reply(output)
            if cancelled():
                raise Cancelled()
        except Exception as error:
            self._abandon(successor)
            with self._lock:
                self.reservations.restore(*undo)
            raise self._failure(error, "building the step's answer") from error

    def _guess_next(self, step: Step, output: StepOutput) -> Ahead | None:
        """Guesses.reserve, where a failure costs only the guess: the step itself is done and answered."""
        try:
            return self.guesses.reserve(step, output, self._run_guess)
        except Exception:
            log.exception("run_ahead_failed")
            return None

    def _run(self, step: Step, cancelled: Callable[[], bool]) -> tuple[StepOutput, tuple[dict, Plan]]:
        """The step's outputs, and what undoes it (Reservations.restore's arguments)."""
        plan, snapshot = self._plan(step)
        started = time.perf_counter()
        try:
            outputs = [out for chunks in plan.rounds for out in self.rounds.run(chunks, cancelled)]
        except Exception as error:
            self._quiesce()
            with self._lock:
                self.reservations.restore(snapshot, plan)
            raise self._failure(error, "running the step") from error
        # Rounds finish prompts in chunk order; the reply lists decode tokens, then prompts, in request order.
        order = {seq_id: i for i, seq_id in enumerate(step.seq_ids)}
        outputs.sort(key=lambda out: order[out.seq_id])
        return StepOutput(outputs, int((time.perf_counter() - started) * 1e6)), (snapshot, plan)

    def _failure(self, error: Exception, doing: str) -> WorkerError:
        """The error a call that failed (and was undone) raises: a request's own error as it is; the device's own
        failure as a DeviceFault (the worker stops serving); anything else, a bug, as StepFailed, for this call
        alone."""
        if isinstance(error, WorkerError):
            return error
        if isinstance(error, self.runner.device_errors):
            return DeviceFault(f"the device failed {doing}: {describe(error)}")
        log.error("step_failed", doing=doing, exc_info=error)
        return StepFailed(f"an internal error while {doing}: {describe(error)}; the call changed nothing, the "
                          f"worker serves on")

    def _plan(self, step: Step) -> tuple[Plan, dict]:
        """Plans the step and takes its blocks."""
        def take():
            matches = self.reservations.match_prompts(step)
            cached = cached_of(matches, self.cache.blocks)
            plan = plan_step(step, self.sequences, self.cache.blocks.num_free, self.limits, cached)
            return plan, self.reservations.reserve(plan, matches)

        try:
            return self.guesses.taking_blocks(take)
        except Exception as error:
            raise self._failure(error, "planning the step") from error

    def match_prefix(self, tokens: list[int], cache_salt: str = "") -> int:
        """The leading tokens of a prompt the prefix cache would serve now (MatchPrefix); changes nothing."""
        if not self.cache.prefix_cache or not tokens:
            return 0
        with self._lock:
            return self.reservations.match(tokens, cache_salt).tokens

    def backend_counters(self) -> dict[str, int]:
        """The backend's cumulative counts for the metrics (Runner.counters)."""
        return self.runner.counters()

    def stats(self) -> EngineStats:
        """Blocks held by guessed steps count as free: any request may have them."""
        with self._lock:
            guessed = self.guesses.blocks_held()
            blocks = self.cache.blocks
            return EngineStats(blocks.num_blocks, blocks.num_free + guessed, len(self.sequences),
                               self.cache.num_cached)

    def release(self, seq_ids: list[int] | None) -> ReleaseResult:
        """Frees the given sequences (None: all of them) and their blocks."""
        with self._lock:
            ids = self.sequences.ids() if seq_ids is None else seq_ids
        self.guesses.settle(ids)
        with self._lock:
            return self.reservations.release(ids)

    def release_idle(self, seq_ids: list[int], seconds: float) -> ReleaseResult:
        """release() of those of seq_ids no step or Fork has touched for `seconds` (a step may have touched one since
        the caller found it idle)."""
        with self._lock:
            idle = set(self.sequences.idle(seconds, time.monotonic()))
        return self.release([i for i in seq_ids if i in idle])

    def idle_seq_ids(self, seconds: float) -> list[int]:
        """The sequences no step or Fork has touched for `seconds`."""
        with self._lock:
            return self.sequences.idle(seconds, time.monotonic())

    def prefill_tail_split(self, num_tokens: int) -> int | None:
        """Where a prompt of num_tokens should end a non-last chunk: the last block boundary strictly inside it, for
        a model whose recurrent state is snapshotted at block boundaries; None for a model without one."""
        return tail_split(num_tokens, self.config.kv_block_size) if self.cache.has_state else None

    def normalize_states(self, seq_ids: list[int]) -> None:
        """Brings the sequences' recurrent states to their canonical form: each the state after its last answered
        step, in the slot the sequence holds, with no guessed step (run-ahead) advancing it; a guess that would is
        undone. UnknownSequence, with nothing changed, where an id is not live. Idempotent."""
        with self._lock:
            unknown = [i for i in seq_ids if i not in self.sequences]
        if unknown:
            raise UnknownSequence(unknown)
        self.guesses.settle(seq_ids)

    def fork(self, parent_id: int, child_ids: list[int]) -> ForkResult:
        """New sequences continuing the parent from where it is (forks.py), all or none; their block copies are
        done on this stream before the call returns, so any stream may run a child next."""
        self.guesses.settle([parent_id])
        # under the state lock, taking back the blocks and state slots other sequences' guesses hold where it must
        result, copies, state_copies = self.guesses.taking_blocks(
            lambda: fork(self.sequences, self.cache, check_fork(self.sequences, self.cache, parent_id, child_ids),
                         child_ids))
        try:
            if copies:
                self.forwards.copy_blocks(copies)
            if state_copies:
                self.forwards.copy_states(state_copies)
            if copies or state_copies:
                self.runner.synchronize()
        except Exception as error:
            with self._lock:
                for child_id in child_ids:
                    self.reservations.free(self.sequences.remove(child_id))
            raise self._failure(error, "copying the forked blocks") from error
        with self._lock:     # the children were added now
            self.sequences.touch([parent_id], time.monotonic())
        return result

    @property
    def ahead_counts(self) -> RunAheadCounts:
        return self.guesses.counts

    @property
    def prefix_counts(self) -> PrefixCounts | None:
        """The prefix cache's hits, misses and evictions; None where it is off."""
        return self.cache.prefix_counts

    @property
    def is_encoder_decoder(self) -> bool:
        return getattr(self.model.config, "is_encoder_decoder", False)

    @property
    def supports_beam(self) -> bool:
        return self.runner.supports_beam

    def beam_generate(self, requests: list[BeamRequest], eos_token_ids: tuple[int, ...], fill_token: int,
                      cancelled: Callable[[], bool] = lambda: False) -> list[BeamResult]:
        """Runs one BeamGenerate call (runtime/beam/): its KV blocks are reserved from the pool for the worst case
        up front (OutOfKvBlocks if they are not free) and all given back at the end. No sequence is touched."""
        if not self.supports_beam:
            raise FailedPrecondition(f"beam search is not available for this model on the {self.runner.device} "
                                     f"backend yet (supports_beam=false)")
        model = self.forwards.beam_model(len(requests), eos_token_ids, fill_token)
        call = BeamCall(requests, self.limits, self.config.kv_block_size, model)
        pool, slots = self._reserve_beam_cache(call.blocks_needed(),
                                               call.state_slots_needed() if self.cache.has_state else 0)
        try:
            return call.run(pool, cancelled, slots if self.cache.has_state else None)
        except Exception as error:
            raise self._failure(error, "running the beam search") from error
        finally:
            self._quiesce()
            with self._lock:
                self.cache.free(pool.ids, slots)

    def _reserve_beam_cache(self, num_blocks: int, num_slots: int) -> tuple[BlockPool, list[int]]:
        """The call's own block pool (a reservation out of the engine's, whose blocks its beams share by
        reference) and state slots, both or neither."""
        def take():
            blocks, slots = self.cache.reserve(num_blocks, num_slots)
            return BlockPool(num_blocks, self.config.kv_block_size, blocks), slots
        return self.guesses.taking_blocks(take)

    def bind_stream(self, stream: int) -> None:
        """Run first on each device stream's thread: the runner binds the thread to the stream."""
        self.runner.bind_stream(stream)

    def rows_returning_logits(self, step: Step) -> int:
        """How many of the step's outputs will carry a logits row (OutputOptions.return_logits), known before it
        runs: for the answer's size."""
        with self._lock:
            return rows_returning_logits(step, self.sequences)

    def live_seq_ids(self) -> list[int]:
        with self._lock:
            return self.sequences.ids()

    def _run_guess(self, ahead: Ahead, on_queued: Callable[[], None]) -> GuessOutput:
        """Queues the guess (where the engine has not already), reserves its successor while the device works,
        then waits for the guess's sampling: its tokens, and its outputs built once the request that takes it has
        queued the successor (the device's wait for the host is only what that takes)."""
        started = time.perf_counter()
        try:
            launched = ahead.launched or self.rounds.launch(ahead.plan.rounds[0], lambda: False, ahead.staged,
                                                            ahead.tokens)
            on_queued()
            self._reserve_successor(ahead)
            result = self.rounds.result(launched)
        except Exception:
            self._quiesce()     # before whoever settles the guess gives its blocks back
            raise
        finally:
            ahead.launched = ahead.staged = None
        forward_us = int((time.perf_counter() - started) * 1e6)
        return GuessOutput(result.tokens, lambda: StepOutput(outputs_of(launched, result), forward_us))

    def _reserve_successor(self, ahead: Ahead) -> None:
        """Guesses.reserve_next, and the successor's inputs staged, where a failure costs only the successor. Its
        sampling rows too, unless one reads the tokens its sequence will hold by then (penalties): each row samples
        at the position after its one token."""
        try:
            if (successor := self.guesses.reserve_next(ahead)) is not None:
                chunks = successor.plan.rounds[0]
                staged = successor.staged = self.rounds.stage(chunks)
                if not any(seq.sampling.has_penalties for seq in staged.sequences):
                    staged.rows = [SampleRow(seq.sampling, seq.output, seq.seed, c.start + 1, seq.tokens, ())
                                   for c, seq in zip(chunks, staged.sequences)]
                self.runner.stage(staged.batch)
        except Exception:
            log.exception("run_ahead_failed")

    def _quiesce(self) -> None:
        """Waits for this stream's queued device work, so no kernel still writes the KV blocks an undo frees; a
        device too broken to wait on is already reported by the error being handled."""
        try:
            self.runner.synchronize()
        except Exception:
            pass
