"""Decode run-ahead: a stream's next decode step, run while the gateway is still reading the last one.

A gateway decoding a batch sends, as its next Decode, the same sequences with the tokens the worker has just
sampled. Through gRPC that round trip costs ~1 ms of Python on both ends, during which the device would sit
idle. So once a pure decode step is answered, the engine reserves that guessed next step (the same sequences,
in the same order, each with its sampled token) and the stream runs it at once. The next request takes its result
when it is exactly that step; anything else (another token, another batch, a Release, a prefill) first undoes
it, the way a failed step is undone, and then runs as if it had never been. Both paths give the same outputs
bit for bit: the guessed step is the step the request would have run, with the same batch, positions and
Philox offsets.

The guesses chain: while a guess runs on the device, the stream plans and reserves the one after it (its
tokens are the ones the running guess will sample, filled in once they are known), so when the next request takes
the running guess the engine queues its successor at once, before it answers: the device goes from one step to the
next without waiting for the host's planning, answer and bookkeeping. A successor only ever runs once the request
before it took its predecessor; undoing a guess undoes its successor first.

The guess is never made for sequences that asked for logits (their gateway samples for itself), nor where the
step cannot be planned (max_model_len, no free KV block). Blocks a guess holds count as free: a request that
runs short of blocks undoes every guess and plans again.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.errors import OutOfKvBlocks, OutOfStateSlots, WorkerError
from metrale.runtime.planner import Limits, Plan, plan_step
from metrale.runtime.reservation import Reservations
from metrale.runtime.sequence import SequenceTable
from metrale.runtime.step import DecodeToken, Step, StepOutput

log = structlog.get_logger()


@dataclass(eq=False)
class Ahead:
    """A reserved guess: its plan, its tokens (a successor's set by fill()), the state to restore if it is not taken,
    and (once done) its outputs."""
    plan: Plan
    snapshot: dict
    blocks_taken: int
    # run_forward(ahead, on_queued): the guessed step's outputs; on_queued() once its device work is queued.
    run_forward: Callable[["Ahead", Callable[[], None]], "GuessOutput"] = field(repr=False)
    # Each sequence's token, in the plan's order: its round's chunks take them when it is launched.
    tokens: list[int] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: "GuessOutput | None" = None
    # A successor's inputs, built while its predecessor runs (rounds.Staged).
    staged: object = None
    # Its device work, once queued ahead of run() (rounds.Launched): run() then only finishes it.
    launched: object = None
    # The guess after this one, reserved while this one runs (not queued until a request takes this one).
    next: "Ahead | None" = None
    # The plan's sequences, in its order (the same list every time it is asked for).
    seq_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        self.seq_ids = [chunk.seq_id for chunk in self.plan.rounds[0]]

    @property
    def queued(self) -> bool:
        return self.launched is not None

    def matches(self, step: Step) -> bool:
        """Whether the pure decode step is exactly this guess: its sequences, in order, each with its token."""
        return (self.result is not None and step.seq_ids == self.seq_ids
                and [entry.token for entry in step.decode] == self.tokens)

    def fill(self, tokens: list[int]) -> None:
        """A successor's tokens: what its predecessor sampled, in order."""
        self.tokens = tokens

    @property
    def output(self) -> StepOutput:
        """The guessed step's outputs (built from its sampling's result once asked: a taken guess's after its
        successor is queued)."""
        return self.result.output()

    def run(self, on_queued: Callable[[], None]) -> None:
        """Runs the guessed step (on the stream's thread); on_queued() once its device work is queued. A failure
        leaves no output to take: the request then runs the step itself and meets the error (a device fault)
        there, as its own; it is logged here too, so that a guess path that always fails shows."""
        try:
            self.result = self.run_forward(self, on_queued)
        except Exception:
            log.exception("run_ahead_failed")
            self.result = None
        finally:
            self.done.set()

    def skip(self) -> None:
        """The stream has other work queued: leave the guess unrun; the next step on its sequences undoes it."""
        self.done.set()


class GuessOutput:
    """A guess's outputs as its sampling left them: its tokens at once (its successor's, when a request takes it),
    the StepOutput built once, when first asked for."""

    __slots__ = ("tokens", "_build", "_output")

    def __init__(self, tokens: list[int], build: Callable[[], StepOutput]):
        self.tokens, self._build, self._output = tokens, build, None

    def output(self) -> StepOutput:
        if self._output is None:
            self._output = self._build()
        return self._output


@dataclass
class RunAheadCounts:
    # Guesses the next request took; guesses undone (run or skipped).
    taken: int = 0
    undone: int = 0


class Guesses:
    """The engine's guessed next steps by seq_id, each sequence in at most one; read and changed under the engine's
    state lock, which it shares."""

    def __init__(self, lock: threading.Lock, sequences: SequenceTable, cache: CacheManager,
                 reservations: Reservations, limits: Limits):
        self._lock, self.sequences, self.cache = lock, sequences, cache
        self.reservations, self.limits = reservations, limits
        self._ahead: dict[int, Ahead] = {}
        # Requests waiting for blocks that guesses hold: no new guess is made meanwhile.
        self._blocks_wanted = 0
        self.counts = RunAheadCounts()

    def blocks_held(self) -> int:
        """The blocks the guesses (and their successors) hold, which count as free; the caller holds the lock."""
        return sum(a.blocks_taken + (a.next.blocks_taken if a.next else 0) for a in set(self._ahead.values()))

    def reserve(self, step: Step, output: StepOutput,
                run_forward: Callable[[Ahead, Callable[[], None]], StepOutput]) -> Ahead | None:
        """Reserves the guessed next step of a pure decode step: the same sequences, each with its sampled token;
        None where no guess is made."""
        if step.prefill or not step.decode:
            return None
        sampled = {out.seq_id: out.token for out in output.outputs}
        with self._lock:
            if self._blocks_wanted or any(self.sequences.get(i).output.return_logits for i in sampled):
                return None
            guess = Step(decode=tuple(DecodeToken(entry.seq_id, sampled[entry.seq_id]) for entry in step.decode))
            ahead = self._reserve(guess, run_forward)
            if ahead is not None:
                ahead.tokens = [entry.token for entry in guess.decode]
                self._ahead.update(dict.fromkeys(ahead.seq_ids, ahead))
        return ahead

    def reserve_next(self, ahead: Ahead) -> Ahead | None:
        """Reserves the successor of a guess whose device work is queued (its sequences hold its tokens): the same
        sequences again, tokens to be filled. Not registered: settle() does that when a request takes `ahead`."""
        with self._lock:
            if self._blocks_wanted:
                return None
            # Tokens 0 in its plan: the plan needs the sequences and their lengths, not the tokens (fill() gives them).
            ahead.next = self._reserve(Step(decode=tuple(map(DecodeToken, ahead.seq_ids, [0] * len(ahead.seq_ids)))),
                                       ahead.run_forward)
        return ahead.next

    def _reserve(self, guess: Step, run_forward) -> Ahead | None:
        """The guess planned and its blocks taken; None where it cannot be planned. The caller holds the lock."""
        try:
            plan = plan_step(guess, self.sequences, self.cache.blocks.num_free, self.limits)
        except WorkerError:     # max_model_len, or no free block: no guess
            return None
        free = self.cache.blocks.num_free
        try:        # a guess takes only free state slots: it never evicts a snapshot
            snapshot = self.reservations.reserve(plan, evict_snapshots=False)
        except OutOfStateSlots:
            return None
        return Ahead(plan, snapshot, free - self.cache.blocks.num_free, run_forward)

    def settle(self, seq_ids: list[int], step: Step | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> Ahead | None:
        """Waits for the guesses on these sequences; returns the one that is exactly `step` (taken: its state
        stays, and its successor, its tokens filled, becomes the sequences' guess), and undoes every other one."""
        with self._lock:
            if not self._ahead:
                return None
            pending = self._pending(seq_ids)
        for ahead in pending:
            ahead.done.wait()
        taken = None
        with self._lock:
            for ahead in pending:
                if self._ahead.get(ahead.seq_ids[0]) is not ahead:     # settled by another stream meanwhile
                    continue
                if step is not None and not step.prefill and ahead.matches(step) and not cancelled():
                    taken = ahead
                    self.counts.taken += 1
                    if (successor := ahead.next) is not None:   # the same sequences: it takes their entries over
                        successor.fill(ahead.result.tokens)
                        self._ahead.update(dict.fromkeys(successor.seq_ids, successor))
                        continue
                else:
                    self._undo(ahead)
                for seq_id in ahead.seq_ids:
                    del self._ahead[seq_id]
        return taken

    def _pending(self, seq_ids: list[int]) -> list[Ahead]:
        """The guesses on these sequences, each once; the caller holds the lock. A step on exactly one guess's
        sequences (a gateway's next decode step) is found without a look at each."""
        first = self._ahead.get(seq_ids[0]) if seq_ids else None
        if first is not None and first.seq_ids == seq_ids:
            return [first]
        return list({id(a): a for i in seq_ids if (a := self._ahead.get(i)) is not None}.values())

    def abandon(self, ahead: Ahead) -> None:
        """Undoes a taken guess's successor that the engine queued and then could not go on with (its device work
        waited for by the caller, on its stream's thread)."""
        with self._lock:
            for seq_id in ahead.seq_ids:
                if self._ahead.get(seq_id) is ahead:
                    del self._ahead[seq_id]
            self._undo(ahead)
        ahead.done.set()

    def _undo(self, ahead: Ahead) -> None:
        """Gives back what the guess (and, first, its unqueued successor) reserved. The caller holds the lock."""
        if ahead.next is not None:
            self.reservations.restore(ahead.next.snapshot, ahead.next.plan)
            ahead.next = None
        self.reservations.restore(ahead.snapshot, ahead.plan)
        self.counts.undone += 1

    def taking_blocks(self, take: Callable[[], object]):
        """take() under the state lock. Where it is short of blocks or state slots while guesses hold some, no new
        guess is made until it is done, and the held ones are undone, until take() succeeds or no guess holds any:
        what guesses hold is free for any request, as Info says."""
        waiting = False
        try:
            while True:
                with self._lock:
                    try:
                        return take()
                    except (OutOfKvBlocks, OutOfStateSlots):
                        if not self._ahead:
                            raise
                        self._blocks_wanted += not waiting
                        waiting, guessed = True, list(self._ahead)
                self.settle(guessed)
        finally:
            if waiting:
                with self._lock:
                    self._blocks_wanted -= 1


class StreamPacer:
    """What a stream does once a step is done, with its guess: queue the guess on the device and hand the
    answer over (to the event loop, which sends it and takes the next request), in the better order.

    Both orders compete for the interpreter lock. Where the device time d of a step is longer than the answer's
    round trip r (client and gRPC, ~1.3 ms), queuing the guess first hides the round trip in the device time and
    keeps the event loop off the guess's host work (Llama-3-8B at batch 1: 5.5 -> 4.7 ms per step). Where r is
    longer than d (the default model's 0.6 ms steps), the answer path is the critical one and the answer goes
    first, the guess's host work overlapping the round trip (SmolLM2 at batch 1: 1.9 -> 1.4 ms). The stream
    measures both and picks the answer first once r exceeds d by ANSWER_FIRST_MARGIN_S.
    """

    def __init__(self):
        self.round_trip_s = 0.0     # moving averages
        self.device_s = 0.0
        self._handed_at = None

    @property
    def answer_first(self) -> bool:
        return self.round_trip_s > self.device_s + ANSWER_FIRST_MARGIN_S

    def request_arrived(self) -> None:
        """The handler calls this as a request for the stream arrives: the end of the last answer's round trip."""
        handed, self._handed_at = self._handed_at, None
        if handed is not None:
            self.round_trip_s = _average(self.round_trip_s, time.perf_counter() - handed)

    def __call__(self, output: StepOutput, stream_idle: bool, hand_over: Callable[[], None]) -> None:
        ahead = output.ahead
        if ahead is None:
            hand_over()
            return
        if not (stream_idle or ahead.queued):
            try:
                hand_over()
            finally:        # whatever happens to the answer, the guess is settled: skipped, never left pending
                ahead.skip()
            return
        handed, queued_at = False, None

        def answer():
            nonlocal handed
            if not handed:
                handed = True
                self._handed_at = time.perf_counter()
                hand_over()

        def on_queued():
            nonlocal queued_at
            queued_at = time.perf_counter()
            answer()

        try:
            if self.answer_first:
                answer()
        finally:            # a queued guess is always waited for, so no later step finds it pending
            ahead.run(on_queued)
        answer()    # a guess that failed before it was queued
        if queued_at is not None:
            self.device_s = _average(self.device_s, time.perf_counter() - queued_at)


# The answer goes first when its round trip is this much longer than the guess's device time: a little of the
# guess's host work then competes with the event loop's.
ANSWER_FIRST_MARGIN_S = 0.2e-3


def _average(average: float, sample: float, weight: float = 0.25) -> float:
    return sample if average == 0.0 else average + weight * (sample - average)
