"""Steps: a gateway's long-lived step channel.

Each StepRequest is a Decode, Prefill or MixedForward, run exactly as the unary RPC runs it (the same checks,
admission, stream, atomicity and cancellation); its StepResponse carries the unary answer, or the status the unary
call would have ended with, and the channel stays open. Requests are submitted in the order they arrive, except
that a step naming a sequence an earlier step of the channel still holds waits for that step (a gateway may send a
sequence's Decode right behind its Prefill; two unary calls would get ABORTED); responses go out in arrival order
per stream, each as soon as its step (and every earlier step of its stream) is answered. Steps on different streams overlap and may answer out of order: step_id
says which is which. Cancelling the channel cancels its steps in flight, which are undone as a cancelled unary
call's step is.
"""

import asyncio
import contextlib
import time

import structlog

from metrale.runtime.errors import InvalidArgument
from metrale.service import convert
from metrale.service.status import step_error
from metrale.v1 import worker_pb2 as pb

RPC = "Steps"
# The request each kind of step carries, and its step.
KINDS = {"decode": convert.step_from_decode, "prefill": convert.step_from_prefill, "mixed": convert.step_from_mixed}


def seq_ids_of(request: pb.StepRequest, kind: str | None) -> list[int]:
    """The sequences a step request names (unchecked: the step's own checks come later)."""
    if kind == "decode":
        return list(request.decode.seq_ids)
    if kind == "prefill":
        return [s.seq_id for s in request.prefill.slices]
    if kind == "mixed":
        return [*request.mixed.decode.seq_ids, *(s.seq_id for s in request.mixed.prefill.slices)]
    return []


class StepChannel:
    """One open Steps call: a task per request, each writing its response after its stream's previous one."""

    def __init__(self, servicer, context):
        self.servicer = servicer
        self.context = context
        self._writing = asyncio.Lock()       # one write at a time on the call
        self._in_flight: dict[asyncio.Task, tuple[pb.StepRequest, str | None]] = {}    # unanswered steps

    async def serve(self, requests) -> None:
        last: dict[int, asyncio.Task] = {}      # per stream: its newest step, which the next one answers after
        try:
            async for request in requests:
                kind = request.WhichOneof("step")
                stream = getattr(request, kind).stream if kind else 0
                # Usually every earlier step is answered, and nothing is looked at; else the steps in flight that
                # name one of this step's sequences.
                waits = self._holding(seq_ids_of(request, kind)) if self._in_flight else set()
                task = asyncio.ensure_future(self._answer(request, kind, last.get(stream), waits))
                last[stream] = task
                self._in_flight[task] = (request, kind)
                task.add_done_callback(self._forget)
            while self._in_flight:               # the client is done writing: answer what it sent
                await asyncio.wait(set(self._in_flight))
        finally:
            # Cancelled (client cancel, deadline, server stop): every step in flight is cancelled as its unary call
            # would be, and the channel ends once each is undone or answered.
            for task in self._in_flight:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*self._in_flight, return_exceptions=True)

    def _holding(self, seq_ids: list[int]) -> set[asyncio.Task]:
        ids = set(seq_ids)
        return {task for task, (request, kind) in self._in_flight.items()
                if not task.done() and not ids.isdisjoint(seq_ids_of(request, kind))}

    def _forget(self, task: asyncio.Task) -> None:
        self._in_flight.pop(task, None)

    async def _answer(self, request: pb.StepRequest, kind: str | None, previous: asyncio.Task | None,
                      waits: set[asyncio.Task]) -> None:
        started = time.perf_counter()
        response = pb.StepResponse(step_id=request.step_id)
        with structlog.contextvars.bound_contextvars(rpc=RPC, step_id=request.step_id):
            try:
                if waits:       # an earlier step of this channel names one of its sequences: after it, in order
                    await asyncio.gather(*waits, return_exceptions=True)
                if kind is None:
                    raise InvalidArgument("the step request is empty: set decode, prefill or mixed")
                inner = getattr(request, kind)
                await self.servicer._forward(inner, KINDS[kind], inner.stream, envelope=response)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                response.ClearField("result")
                response.error.CopyFrom(step_error(error, RPC, self.servicer.metrics, self.servicer.on_fault))
        self.servicer.metrics.seconds_of(RPC).observe(time.perf_counter() - started)
        if previous is not None:
            with contextlib.suppress(BaseException):        # its failure is its own response's
                await previous
        async with self._writing:
            await self.context.write(response)
