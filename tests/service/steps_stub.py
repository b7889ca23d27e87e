"""The forward RPCs over the Steps channel, behind the unary stub's interface, so that the API tests run over both.

In "steps" mode a stub's Prefill, Decode and MixedForward send a StepRequest on a Steps channel that the calling
thread keeps open, and turn the StepResponse back into what the unary call gives: its ForwardResponse, or an
RpcError with the error's code, message and details. A call with a timeout or metadata opens a channel of its own
with them (a deadline or a cancel then ends that channel, which must undo its step as it undoes a unary call's);
`.future()` does the same on a thread.
"""

import itertools
import queue
import threading
from concurrent.futures import Future

import grpc
from google.rpc import status_pb2

from metrale.v1 import worker_pb2 as pb

STEP_RPC = {"mode": "unary"}
KINDS = {"Prefill": "prefill", "Decode": "decode", "MixedForward": "mixed"}
_step_ids = itertools.count(1)


def rpc_name(unary: str) -> str:
    """The RPC a forward call is counted under in the metrics: its own name, or Steps over the channel."""
    return "Steps" if STEP_RPC["mode"] == "steps" and unary in KINDS else unary


class StepError(grpc.RpcError, grpc.Call):
    """A StepResponse's error, as the unary call's RpcError (rpc_status.from_call reads its details too)."""

    def __init__(self, status: status_pb2.Status):
        self.status = status

    def code(self) -> grpc.StatusCode:
        return next(c for c in grpc.StatusCode if c.value[0] == self.status.code)

    def details(self) -> str:
        return self.status.message

    def trailing_metadata(self):
        return (("grpc-status-details-bin", self.status.SerializeToString()),)

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False

    def __str__(self):
        return f"<StepError {self.code().name}: {self.details()}>"


class _Channel:
    """One open Steps call: requests in through a queue, responses read one at a time."""

    def __init__(self, stub, timeout=None, metadata=None):
        self.requests = queue.SimpleQueue()
        self.call = stub.Steps(iter(self.requests.get, None), timeout=timeout, metadata=metadata)

    def step(self, kind: str, request):
        message = pb.StepRequest(step_id=next(_step_ids), **{kind: request})
        self.requests.put(message)
        response = next(self.call)
        assert response.step_id == message.step_id, (response.step_id, message.step_id)
        if response.HasField("error"):
            raise StepError(response.error)
        return response.result

    def close(self) -> None:
        self.requests.put(None)


class _Future(Future):
    """A step on a channel of its own, run on a thread; cancel() cancels the channel (grpc's future cancels its
    call)."""

    def __init__(self, stub, kind, request, timeout, metadata):
        super().__init__()
        self.channel = _Channel(stub, timeout, metadata)
        threading.Thread(target=self._run, args=(kind, request), daemon=True).start()

    def _run(self, kind, request):
        try:
            self.set_result(self.channel.step(kind, request))
        except BaseException as error:   # handed to result()
            if not self.cancelled():
                self.set_exception(error)
        finally:
            self.channel.close()

    def cancel(self) -> bool:
        self.channel.call.cancel()
        return super().cancel()


class _StepMethod:
    def __init__(self, owner: "ModeStub", kind: str):
        self.owner, self.kind = owner, kind

    def __call__(self, request, timeout=None, metadata=None, **_):
        if timeout is not None or metadata is not None:
            channel = _Channel(self.owner.stub, timeout, metadata)
            try:
                return channel.step(self.kind, request)
            finally:
                channel.close()
        local = self.owner.local
        if getattr(local, "channel", None) is None:
            local.channel = _Channel(self.owner.stub)
        try:
            return local.channel.step(self.kind, request)
        except grpc.RpcError as error:
            if not isinstance(error, StepError):         # the channel itself ended (e.g. a message over the limit)
                local.channel = None
            raise

    def future(self, request, timeout=None, metadata=None, **_):
        return _Future(self.owner.stub, self.kind, request, timeout, metadata)


class ModeStub:
    """A Worker stub whose forward RPCs go over Steps while STEP_RPC["mode"] is "steps"."""

    def __init__(self, stub):
        self.stub = stub
        self.local = threading.local()

    def __getattr__(self, name):
        if name in KINDS and STEP_RPC["mode"] == "steps":
            return _StepMethod(self, KINDS[name])
        return getattr(self.stub, name)
