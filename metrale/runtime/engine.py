"""The engine: runs validated steps over the sequence table, the KV pool and the model. Step = plan, run, sample."""

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import Cancelled, DeviceFault, WorkerError
from metrale.runtime.kv_blocks import KvBlockManager, blocks_for
from metrale.runtime.planner import Chunk, Limits, Plan, plan_step
from metrale.runtime.sampling import SampleRow, random_seed
from metrale.runtime.sequence import Sequence, SequenceTable
from metrale.runtime.step import SequenceOutput, Step, StepOutput


@dataclass(frozen=True)
class EngineStats:
    num_kv_blocks: int
    free_kv_blocks: int
    live_sequences: int


@dataclass
class ReleaseResult:
    released: list[int]
    unknown: list[int]
    blocks_freed: int


class Engine:
    """Owns all model state. Steps on disjoint sequences may run on several lanes at once: planning and
    committing hold the state lock; the forward itself does not."""

    def __init__(self, model, kv_cache: list, num_kv_blocks: int, config: EngineConfig, max_model_len: int):
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.sequences = SequenceTable()
        self.blocks = KvBlockManager(num_kv_blocks, config.kv_block_size)
        self.limits = Limits(max_model_len, config.max_batch_tokens, config.kv_block_size, config.max_seqs)
        self._lock = threading.Lock()
        # Held around each forward where the backend cannot run two at once.
        self._forward_lock = contextlib.nullcontext() if model.ops.concurrent_forwards else threading.Lock()

    def step(self, step: Step, cancelled: Callable[[], bool] = lambda: False) -> StepOutput:
        """Runs the step, or changes nothing: on any error, or if cancelled() before its last commit."""
        with self._lock:
            plan = plan_step(step, self.sequences, self.blocks.num_free, self.limits)
            snapshot = self._reserve(plan)
        started = time.perf_counter()
        try:
            outputs = [out for chunks in plan.rounds for out in self._run_round(chunks, cancelled)]
        except Exception as error:
            with self._lock:
                self._restore(snapshot, plan)
            if isinstance(error, WorkerError):
                raise
            raise DeviceFault(f"the step failed on the device: {error!r}") from error
        # Rounds finish prompts in chunk order; the reply lists decode lanes, then prompts, in request order.
        order = {seq_id: i for i, seq_id in enumerate(step.seq_ids)}
        outputs.sort(key=lambda out: order[out.seq_id])
        return StepOutput(outputs, int((time.perf_counter() - started) * 1e6))

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(self.blocks.num_blocks, self.blocks.num_free, len(self.sequences))

    def release(self, seq_ids: list[int] | None) -> ReleaseResult:
        """Frees the given sequences (None: all of them) and their blocks."""
        with self._lock:
            ids = self.sequences.ids() if seq_ids is None else seq_ids
            released, unknown, freed = [], [], 0
            for seq_id in ids:
                seq = self.sequences.remove(seq_id)
                if seq is None:
                    unknown.append(seq_id)
                    continue
                self.blocks.free(seq.block_table.tolist())
                freed += len(seq.block_table)
                released.append(seq_id)
            return ReleaseResult(released, unknown, freed)

    def live_seq_ids(self) -> list[int]:
        with self._lock:
            return self.sequences.ids()

    def _reserve(self, plan: Plan) -> dict:
        """Creates new sequences and takes every block the step needs; returns what _restore needs."""
        snapshot = {i: (seq.num_tokens, len(seq.block_table), seq.prompt_finished, seq.num_prompt_tokens)
                    for i in plan.final_lengths if (seq := self.sequences.get(i)) is not None}
        for s in plan.new_sequences:
            seed = s.sampling.seed if s.sampling.seed is not None else random_seed()
            self.sequences.add(Sequence(s.seq_id, s.sampling, s.output, seed))
        block_size = self.blocks.kv_block_size
        for seq_id, length in plan.final_lengths.items():
            table = self.sequences.get(seq_id).block_table
            missing = blocks_for(length, block_size) - len(table)
            if missing > 0:
                table.extend(self.blocks.allocate(missing))
        return snapshot

    def _restore(self, snapshot: dict, plan: Plan) -> None:
        for seq_id in plan.final_lengths:
            seq = self.sequences.get(seq_id)
            if seq_id not in snapshot:
                self.sequences.remove(seq_id)
                self.blocks.free(seq.block_table.tolist())
                continue
            num_tokens, num_blocks, finished, num_prompt = snapshot[seq_id]
            del seq.tokens[num_tokens:]
            self.blocks.free(seq.block_table.truncate(num_blocks))
            seq.prompt_finished, seq.num_prompt_tokens = finished, num_prompt

    def forward(self, batch):
        """The model over one flat batch, logits on the device (the backend calls it, or captures it)."""
        return self.model.forward(batch, self.kv_cache)

    def _run_round(self, chunks: tuple[Chunk, ...], cancelled: Callable[[], bool]) -> list[SequenceOutput]:
        sequences = [self.sequences.get(c.seq_id) for c in chunks]
        segments = [Segment(seq.block_table, c.start, c.tokens, c.samples) for c, seq in zip(chunks, sequences)]
        batch = build_batch(segments, self.config.kv_block_size)
        ops = self.model.ops
        with self._forward_lock:
            # The logits live in the backend's memory until sampled: the lock covers both.
            logits = ops.run_forward(self.forward, batch)
            if cancelled():
                raise Cancelled()
            with self._lock:
                for c, seq in zip(chunks, sequences):
                    seq.tokens.extend(c.tokens)
                    if not seq.prompt_finished:
                        seq.num_prompt_tokens = seq.num_tokens
                        seq.prompt_finished = c.ends_prompt
            sampled = [seq for c, seq in zip(chunks, sequences) if c.samples]
            if not sampled:
                return []
            # The token lists go by reference; the generated tokens are sliced out only where penalties read them.
            rows = [SampleRow(s.sampling, s.output, s.seed, s.num_tokens, s.tokens,
                              s.output_tokens if s.sampling.has_penalties else ()) for s in sampled]
            result = ops.sample(logits, rows)
        return [SequenceOutput(seq.seq_id, result.tokens[i], result.logprobs[i], result.top_logprobs[i],
                               result.logits[i]) for i, seq in enumerate(sampled)]
