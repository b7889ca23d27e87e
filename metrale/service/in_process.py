"""A worker served from a background thread of this process, with a blocking client: for tests, benchmarks
and embedding the worker in a Python program."""

import asyncio
import threading
from typing import Callable

import grpc

from metrale.service.server import WorkerServer
from metrale.v1 import worker_pb2_grpc

CLIENT_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


class InProcessWorker:
    """make_server() runs on the worker's own event loop thread (grpc.aio objects bind to the loop that makes
    them); the server is started at once and `stub` talks to it over a loopback channel."""

    def __init__(self, make_server: Callable[[], WorkerServer]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="worker-event-loop", daemon=True)
        self.thread.start()
        self.server = self.call(self._construct(make_server))
        self.call(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.address, options=CLIENT_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    @staticmethod
    async def _construct(make_server):
        return make_server()

    def call(self, coroutine, timeout: float = 120.0):
        """Runs a coroutine on the worker's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def engine(self):
        return self.server.servicer.engine

    def stop(self) -> None:
        self.channel.close()
        self.call(self.server.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self) -> "InProcessWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
