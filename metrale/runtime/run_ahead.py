"""Decode run-ahead: a stream's next decode step, run while the gateway is still reading the last one.

A gateway decoding a batch sends, as its next Decode, the same sequences with the tokens the worker has just
sampled. Through gRPC that round trip costs ~1 ms of Python on both ends, during which the device would sit
idle. So once a pure decode step is answered, the engine reserves that guessed next step (the same sequences,
in the same order, each with its sampled token) and the stream runs it at once. The next request takes its result
when it is exactly that step; anything else (another token, another batch, a Release, a prefill) first undoes
it, the way a failed step is undone, and then runs as if it had never been. Both paths give the same outputs
bit for bit: the guessed step is the step the request would have run, with the same batch, positions and
Philox offsets.

The guess is never made for sequences that asked for logits (their gateway samples for itself), nor where the
step cannot be planned (max_model_len, no free KV block). Blocks a guess holds count as free: a request that
runs short of blocks undoes every guess and plans again.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from metrale.runtime.planner import Plan
from metrale.runtime.step import DecodeToken, StepOutput


@dataclass(eq=False)
class Ahead:
    """A reserved guess: its plan, the state to restore if it is not taken, and (once done) its outputs."""
    decode: tuple[DecodeToken, ...]
    plan: Plan
    snapshot: dict
    blocks_taken: int
    # run_forward(ahead, on_queued): the guessed step's outputs; on_queued() once its device work is queued.
    run_forward: Callable[["Ahead", Callable[[], None]], StepOutput] = field(repr=False)
    done: threading.Event = field(default_factory=threading.Event)
    output: StepOutput | None = None

    @property
    def seq_ids(self) -> list[int]:
        return [entry.seq_id for entry in self.decode]

    def matches(self, decode: tuple[DecodeToken, ...]) -> bool:
        return self.output is not None and decode == self.decode

    def run(self, on_queued: Callable[[], None]) -> None:
        """Runs the guessed step (on the stream's thread); on_queued() once its device work is queued. A failure
        leaves no output to take: the request then runs the step itself and meets the error (a device fault)
        there, as its own."""
        try:
            self.output = self.run_forward(self, on_queued)
        except Exception:
            self.output = None
        finally:
            self.done.set()

    def skip(self) -> None:
        """The stream has other work queued: leave the guess unrun; the next step on its sequences undoes it."""
        self.done.set()


@dataclass
class RunAheadCounts:
    # Guesses the next request took; guesses undone (run or skipped).
    taken: int = 0
    undone: int = 0


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
        if ahead is None or not stream_idle:
            hand_over()
            if ahead is not None:
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

        if self.answer_first:
            answer()
        ahead.run(on_queued)
        answer()    # a guess that failed before it was queued
        if queued_at is not None:
            self.device_s = _average(self.device_s, time.perf_counter() - queued_at)


# The answer goes first when its round trip is this much longer than the guess's device time: a little of the
# guess's host work then competes with the event loop's.
ANSWER_FIRST_MARGIN_S = 0.2e-3


def _average(average: float, sample: float, weight: float = 0.25) -> float:
    return sample if average == 0.0 else average + weight * (sample - average)
