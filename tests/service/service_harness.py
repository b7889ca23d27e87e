"""A real WorkerServer on its own event loop thread, with a blocking client stub, for the API tests."""

import asyncio
import threading

import grpc

from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.service.config import WorkerConfig
from metrale.service.server import WorkerServer
from metrale.v1 import worker_pb2_grpc


class RunningWorker:
    """A WorkerServer on its own event loop thread, with a blocking client stub."""

    def __init__(self, checkpoint, config: WorkerConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(self._create(checkpoint, config))
        self.call(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"
        options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
        self.channel = grpc.insecure_channel(self.address, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    @staticmethod
    async def _create(checkpoint, config):
        return WorkerServer.from_checkpoint(checkpoint, config)

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def engine(self):
        return self.server.servicer.engine

    def stop(self) -> None:
        self.channel.close()
        self.call(self.server.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_worker(directory, metrics_port: int | None = None, **engine) -> RunningWorker:
    config = WorkerConfig(host="127.0.0.1", port=0, max_message_mb=4, drain_timeout=5.0, metrics_port=metrics_port,
                          engine=EngineConfig(device="cpu", **{"kv_blocks": 64, **engine}))
    return RunningWorker(load_checkpoint(directory), config)
