"""One worker as the gateway sees it: its Info, and one Steps channel on which steps go out and their answers come
back matched by step_id."""

import asyncio
import itertools

import grpc
from google.rpc import status_pb2

from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc


class StepFailed(Exception):
    """A step the worker refused or failed: its google.rpc.Status (the step changed nothing)."""

    def __init__(self, status: status_pb2.Status):
        super().__init__(f"{grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == status.code)).name}: "
                         f"{status.message}")
        self.status = status

    @property
    def code(self) -> int:
        return self.status.code


class WorkerLink:
    """open(), then step() from any task; close() at the end."""

    def __init__(self, address: str):
        self.address = address
        self.channel: grpc.aio.Channel | None = None      # open()'s, on the loop that uses it
        self.stub: worker_pb2_grpc.WorkerStub | None = None
        self.info: pb.InfoResponse | None = None
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future] = {}
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._broken: BaseException | None = None      # the Steps channel's end, once it ended

    async def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.info = await self.stub.Info(pb.InfoRequest())
        call = self.stub.Steps(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read(call))

    async def step(self, **step) -> pb.ForwardResponse:
        """Sends one step (decode=, prefill= or mixed= a request message) and waits for its answer; StepFailed if
        the worker answered with an error."""
        if self._broken is not None:
            raise self._broken
        step_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._answers[step_id] = answer
        await self._outbox.put(pb.StepRequest(step_id=step_id, **step))
        return await answer

    async def fork(self, parent: int, children: list[int], stream: int = 0) -> None:
        """Copies of the parent as it is now (its finished prompt and tokens), sharing its full blocks."""
        await self.stub.Fork(pb.ForkRequest(parent_seq_id=parent, child_seq_ids=children, stream=stream))

    async def detokenize(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(tokens=tokens, skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request)).text

    async def release(self, seq_ids: list[int]) -> None:
        await self.stub.Release(pb.ReleaseRequest(seq_ids=seq_ids))

    async def free_blocks(self) -> int:
        return (await self.stub.Info(pb.InfoRequest())).free_kv_blocks

    async def close(self) -> None:
        await self._outbox.put(None)
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=5)
        await self.channel.close()

    async def _requests(self):
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self, call) -> None:
        ended: BaseException = ConnectionError(f"the Steps channel to {self.address} ended")
        try:
            async for response in call:
                answer = self._answers.pop(response.step_id, None)
                if answer is None or answer.done():
                    continue
                if response.HasField("error"):
                    answer.set_exception(StepFailed(response.error))
                else:
                    answer.set_result(response.result)
        except grpc.aio.AioRpcError as error:
            ended = error
        self._broken = ended            # steps sent from now on fail at once; those in flight fail now
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(ended)
        self._answers.clear()
