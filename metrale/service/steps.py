"""Steps: a gateway's long-lived step channel.

Each StepRequest is a Decode, Prefill or MixedForward, run exactly as the unary RPC runs it (the same checks,
admission, stream, atomicity and cancellation); its StepResponse carries the unary answer, or the status the unary
call would have ended with, and the channel stays open. Requests are submitted in the order they arrive, except
that a step naming a sequence an earlier unanswered step of the channel names waits for that step (a gateway may
send a sequence's Decode right behind its Prefill; two unary calls would get ABORTED), and the later steps of its
stream wait behind it. Responses go out in arrival order per stream, each once its step and every earlier step of
its stream are answered; steps on different streams overlap and may answer out of order (step_id says which is
which). Cancelling the channel cancels its unanswered steps, which are undone, or never run, as a cancelled unary
call's step is."""

import asyncio
import time

import structlog

from metrale.runtime.errors import InvalidArgument
from metrale.service import convert
from metrale.service.status import report_error
from metrale.v1 import worker_pb2 as pb

log = structlog.get_logger()
RPC = "Steps"
# Unanswered steps a channel holds before it stops reading the client's.
MAX_UNANSWERED = 64
# Sequences remembered with their newest step; past this many, those of answered steps are forgotten.
HOLDER_LIMIT = 1 << 16
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
        self._in_flight: set[asyncio.Task] = set()      # unanswered steps
        self._holder: dict[int, asyncio.Task] = {}      # per sequence: the newest unanswered step naming it
        self._deferred: set[asyncio.Task] = set()       # steps that wait for another before they run
        self._barrier: asyncio.Task | None = None       # an unanswered step too large to index: all wait for it

    async def serve(self, requests) -> None:
        last: dict[int, asyncio.Task] = {}      # per stream: its newest unanswered step
        try:
            async for request in requests:
                kind = request.WhichOneof("step")
                stream = getattr(request, kind).stream if kind else 0
                waits = self._waits_of(request, kind)
                previous = last.get(stream)
                if previous in self._deferred:      # steps of one stream reach it in the order they arrived
                    waits.add(previous)
                task = asyncio.ensure_future(self._answer(request, kind, previous, waits))
                self._index(task, request, kind)
                if waits:
                    self._deferred.add(task)
                last[stream] = task
                self._in_flight.add(task)
                task.add_done_callback(lambda done, stream=stream: self._forget(done, stream, last))
                if len(self._in_flight) >= MAX_UNANSWERED:      # stop reading: the client's sends wait (HTTP/2)
                    await asyncio.wait(set(self._in_flight), return_when=asyncio.FIRST_COMPLETED)
            while self._in_flight:               # the client is done writing: answer what it sent
                await asyncio.wait(set(self._in_flight))
        finally:
            # Cancelled (client cancel, deadline, server stop): every step in flight is cancelled as its unary call
            # would be, and the channel ends once each is undone or answered.
            for task in self._in_flight:
                task.cancel()
            if self._in_flight:
                await asyncio.wait(set(self._in_flight))

    def _waits_of(self, request: pb.StepRequest, kind: str | None) -> set[asyncio.Task]:
        """The unanswered steps this one must follow: those naming one of its sequences (or every one, where it or
        one of them is too large to look through on the event loop)."""
        if not self._in_flight:
            return set()
        if self._barrier is not None or _large(request, kind):
            return set(self._in_flight)
        return {task for i in seq_ids_of(request, kind) if (task := self._holder.get(i)) is not None}

    def _index(self, task: asyncio.Task, request: pb.StepRequest, kind: str | None) -> None:
        if _large(request, kind):
            self._barrier = task
        else:
            self._holder.update(dict.fromkeys(seq_ids_of(request, kind), task))

    def _forget(self, task: asyncio.Task, stream: int, last: dict[int, asyncio.Task]) -> None:
        self._in_flight.discard(task)
        self._deferred.discard(task)
        if last.get(stream) is task:
            del last[stream]
        if self._barrier is task:
            self._barrier = None
        if not self._in_flight:
            self._holder.clear()
        elif len(self._holder) > HOLDER_LIMIT:
            self._holder = {i: t for i, t in self._holder.items() if not t.done()}
        if not task.cancelled() and task.exception() is not None:     # a write that failed: the call is gone
            log.warning("step_answer_lost", error=repr(task.exception()))

    async def _answer(self, request: pb.StepRequest, kind: str | None, previous: asyncio.Task | None,
                      waits: set[asyncio.Task]) -> None:
        started = time.perf_counter()
        response = pb.StepResponse(step_id=request.step_id)
        with structlog.contextvars.bound_contextvars(rpc=RPC, step_id=request.step_id):
            try:
                # Admitted at arrival: a drain that begins while it waits still lets it run.
                with self.servicer.state.admitted():
                    if waits:   # an earlier step of this channel names one of its sequences: after it, in order
                        await asyncio.wait(waits)
                    if kind is None:
                        raise InvalidArgument("the step request is empty: set decode, prefill or mixed")
                    inner = getattr(request, kind)
                    await self.servicer._forward(inner, KINDS[kind], inner.stream, envelope=response, admit=False)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                response.ClearField("result")
                response.error.CopyFrom(report_error(error, RPC, self.servicer.metrics, self.servicer.on_fault))
        self.servicer.metrics.seconds_of(RPC).observe(time.perf_counter() - started)
        if previous is not None and not previous.done():
            await asyncio.wait((previous,))     # its outcome is its own response's; a cancel of this one still ends it
        async with self._writing:
            await self.context.write(response)


def _large(request: pb.StepRequest, kind: str | None) -> bool:
    return kind is not None and convert.step_id_count(getattr(request, kind)) > convert.INLINE_IDS
