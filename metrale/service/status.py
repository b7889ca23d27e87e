"""The one place runtime errors become gRPC status codes, as a server interceptor."""

import time

import grpc
import structlog
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from metrale.runtime import errors

log = structlog.get_logger()

STATUS_OF = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownSequence: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.OutOfKvBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.OutOfStateSlots: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.BatchTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ReplyTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ListsTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.SequenceBusy: grpc.StatusCode.ABORTED,
    errors.Draining: grpc.StatusCode.UNAVAILABLE,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.StepFailed: grpc.StatusCode.INTERNAL,
    errors.DeviceFault: grpc.StatusCode.INTERNAL,
    errors.RankLost: grpc.StatusCode.UNAVAILABLE,
}
# The services whose handlers raise WorkerErrors; health and reflection are grpc's own and keep their behaviour.
WRAPPED_PREFIX = "/metrale.v1.Worker/"


def status_of(error: errors.WorkerError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.INTERNAL


def _details(error: errors.WorkerError) -> list:
    if isinstance(error, errors.OutOfKvBlocks):
        return [error_details_pb2.ErrorInfo(
            reason="KV_BLOCKS_EXHAUSTED", domain="metrale.v1",
            metadata={"blocks_needed": str(error.blocks_needed), "blocks_free": str(error.blocks_free)})]
    if isinstance(error, errors.OutOfStateSlots):
        return [error_details_pb2.ErrorInfo(
            reason="STATE_SLOTS_EXHAUSTED", domain="metrale.v1",
            metadata={"slots_needed": str(error.slots_needed), "slots_free": str(error.slots_free)})]
    if isinstance(error, errors.BatchTooLarge):
        return [error_details_pb2.ErrorInfo(
            reason=error.limit_name.upper(), domain="metrale.v1",
            metadata={"count": str(error.count), error.limit_name: str(error.limit)})]
    if isinstance(error, errors.ReplyTooLarge):
        return [error_details_pb2.ErrorInfo(
            reason="REPLY_TOO_LARGE", domain="metrale.v1",
            metadata={"reply_bytes": str(error.reply_bytes), "max_message_bytes": str(error.limit_bytes)})]
    return []


def status_message(error: errors.WorkerError) -> status_pb2.Status:
    """The error as google.rpc.Status: code, message and details."""
    status = status_pb2.Status(code=getattr(code_pb2, status_of(error).name), message=str(error))
    for detail in _details(error):
        status.details.add().Pack(detail)
    return status


def report_error(error: Exception, rpc: str, metrics, on_fault) -> status_pb2.Status:
    """What every failed call, and every failed step of a Steps channel, does: counted, logged, a device fault
    reported; its status. An exception no code path expected is a bug, not the device: INTERNAL, with its
    traceback in the log."""
    if not isinstance(error, errors.WorkerError):
        log.exception("unexpected_error", exc_info=error)
        metrics.rpc_errors.labels(rpc, grpc.StatusCode.INTERNAL.name).inc()
        return status_pb2.Status(code=code_pb2.INTERNAL,
                                 message=f"unexpected error in {rpc}: {errors.describe(error)}")
    code = status_of(error)
    metrics.rpc_errors.labels(rpc, code.name).inc()
    log.warning("request_failed", code=code.name, message=str(error))
    if isinstance(error, errors.DeviceFault):
        on_fault()
    return status_message(error)


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Turns an exception raised by any Worker handler into its status code (report_error), and times every RPC;
    on_fault runs for device faults."""

    def __init__(self, on_fault, metrics):
        self._on_fault = on_fault
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(WRAPPED_PREFIX):
            return handler
        rpc = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_call(handler.unary_unary, rpc, timed=True))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, rpc))
        if handler.stream_stream is not None:   # Steps: each step is timed and answered by the channel itself
            return handler._replace(stream_stream=self._wrap_call(handler.stream_stream, rpc, timed=False))
        return handler

    # An RPC's time is observed before its answer or its error status leaves (abort sends the status as it
    # raises): a client that scrapes the metrics after the answer sees the RPC counted.
    def _wrap_call(self, behavior, rpc, timed: bool):
        async def wrapped(request, context):
            timer = _Timer(self._metrics.seconds_of(rpc) if timed else None)
            with structlog.contextvars.bound_contextvars(rpc=rpc):
                try:
                    return await behavior(request, context)
                except Exception as error:
                    await self._abort(context, rpc, error, timer)
                finally:
                    timer.observe()
        return wrapped

    def _wrap_stream(self, behavior, rpc):
        async def wrapped(request, context):
            timer = _Timer(self._metrics.seconds_of(rpc))
            with structlog.contextvars.bound_contextvars(rpc=rpc):
                try:
                    async for item in behavior(request, context):
                        yield item
                except Exception as error:
                    await self._abort(context, rpc, error, timer)
                finally:
                    timer.observe()
        return wrapped

    async def _abort(self, context, rpc: str, error: Exception, timer: "_Timer") -> None:
        if isinstance(error, grpc.aio.AbortError):
            raise error
        timer.observe()
        status = rpc_status.to_status(report_error(error, rpc, self._metrics, self._on_fault))
        await context.abort(status.code, status.details, status.trailing_metadata)


class _Timer:
    """Seconds since creation into a histogram, once, at the first observe()."""

    def __init__(self, histogram):
        self._histogram, self._start = histogram, time.perf_counter()

    def observe(self) -> None:
        if self._histogram is not None:
            self._histogram.observe(time.perf_counter() - self._start)
            self._histogram = None
