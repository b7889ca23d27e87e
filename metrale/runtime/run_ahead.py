"""Decode run-ahead: a lane's next decode step, run while the gateway is still reading the last one.

A gateway decoding a batch sends, as its next Decode, the same sequences with the tokens the worker has just
sampled. Through gRPC that round trip costs ~1 ms of Python on both ends, during which the device would sit
idle. So once a pure decode step is answered, the engine reserves that guessed next step (the same lanes, in
the same order, each with its sampled token) and the lane runs it at once. The next request takes its result
when it is exactly that step; anything else (another token, another batch, a Release, a prefill) first undoes
it, the way a failed step is undone, and then runs as if it had never been. Both paths give the same outputs
bit for bit: the guessed step is the step the request would have run, with the same batch, positions and
Philox offsets.

The guess is never made for sequences that asked for logits (their gateway samples for itself), nor where the
step cannot be planned (max_model_len, no free KV block). Blocks a guess holds count as free: a request that
runs short of blocks undoes every guess and plans again.
"""

import threading
from dataclasses import dataclass, field
from typing import Callable

from metrale.runtime.planner import Plan
from metrale.runtime.step import DecodeLane, StepOutput


@dataclass(eq=False)
class Ahead:
    """A reserved guess: its plan, the state to restore if it is not taken, and (once done) its outputs."""
    decode: tuple[DecodeLane, ...]
    plan: Plan
    snapshot: dict
    blocks_taken: int
    # run_forward(ahead, on_queued): the guessed step's outputs; on_queued() once its device work is queued.
    run_forward: Callable[["Ahead", Callable[[], None]], StepOutput] = field(repr=False)
    done: threading.Event = field(default_factory=threading.Event)
    output: StepOutput | None = None

    @property
    def seq_ids(self) -> list[int]:
        return [lane.seq_id for lane in self.decode]

    def matches(self, decode: tuple[DecodeLane, ...]) -> bool:
        return self.output is not None and decode == self.decode

    def run(self, on_queued: Callable[[], None]) -> None:
        """Runs the guessed step (on the lane's thread); on_queued() once its device work is queued. A failure
        leaves no output to take: the request then runs the step itself and meets the error (a device fault)
        there, as its own."""
        try:
            self.output = self.run_forward(self, on_queued)
        except Exception:
            self.output = None
        finally:
            self.done.set()

    def skip(self) -> None:
        """The lane has other work queued: leave the guess unrun; the next step on its sequences undoes it."""
        self.done.set()


@dataclass
class RunAheadCounts:
    # Guesses the next request took; guesses undone (run or skipped).
    taken: int = 0
    undone: int = 0


def follow_up(output: StepOutput, lane_idle: bool, hand_over: Callable[[], None]) -> None:
    """What a device lane does once a step is done: if nothing else waits on the lane, queue the guess on the
    device and only then hand the answer over (hand_over()), so that the event loop's work on the answer and the
    next request overlaps the guess's device time instead of competing with its host work for the GIL."""
    ahead = output.ahead
    if ahead is None or not lane_idle:
        hand_over()
        if ahead is not None:
            ahead.skip()
        return
    ahead.run(hand_over)
