"""The API's own cost per step: a Decode round trip against a worker whose engine does no work, unary and over the
Steps channel, with a client in its own process as a gateway's; beside it the transport's floor, a bare grpc.aio
server that answers the same messages at once.

Run from the repository root: python -m bench.grpc_overhead [--sizes 1,64,256] [--iterations 2000]
"""

import argparse
import datetime
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import grpc
import structlog
import torch

from bench.grpc_client import StepStream
from bench.stub_model import stub_worker_server
from metrale.runtime.config import EngineConfig
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc


def loopback_config(engine: EngineConfig) -> WorkerConfig:
    return WorkerConfig(host="127.0.0.1", port=0, reflection=False, drain_timeout=5.0, engine=engine)


def machine_line(name: str) -> str:
    """What the figures ran on: CPU model, cores, torch, threads, load and date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return (f"# {name}: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"grpcio {grpc.__version__}, python {platform.python_version()}, load avg {load}, {date}")


@dataclass
class RoundTrip:
    server: str
    rpc: str
    num_sequences: int
    mean_us: float
    p50_us: float
    p99_us: float


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


def summary(server: str, rpc: str, num_sequences: int, times_us: list[float]) -> RoundTrip:
    times_us = sorted(times_us)
    return RoundTrip(server, rpc, num_sequences, statistics.fmean(times_us), percentile(times_us, 0.50),
                     percentile(times_us, 0.99))


def time_client(address: str, sizes: list[int], iterations: int, warmup: int, results) -> None:
    """The gateway's side, in its own process: for each size, unary Decodes, then the same over one Steps channel."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for n in sizes:
            request = pb.DecodeRequest(seq_ids=range(n), tokens=[0] * n)
            for rpc, decode in (("Decode", stub.Decode), ("Steps", StepStream(stub))):
                times = []
                for i in range(warmup + iterations):
                    started = time.perf_counter_ns()
                    response = decode(request)
                    times.append((time.perf_counter_ns() - started) / 1e3)
                    assert len(response.tokens) == n
                if rpc == "Steps":
                    decode.close()
                results.put((rpc, n, times[warmup:]))


class EchoServicer(worker_pb2_grpc.WorkerServicer):
    """The transport alone: each Decode or step answered with its tokens, on the event loop."""

    async def Decode(self, request, context):
        return pb.ForwardResponse(seq_ids=request.seq_ids, tokens=request.tokens)

    async def Steps(self, request_iterator, context):
        async for request in request_iterator:
            d = request.decode
            yield pb.StepResponse(step_id=request.step_id,
                                  result=pb.ForwardResponse(seq_ids=d.seq_ids, tokens=d.tokens))


class EchoServer:
    """EchoServicer on a loopback port, with the start() and drain() InProcessWorker calls."""

    def __init__(self):
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(EchoServicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def start(self) -> None:
        await self.server.start()

    async def drain(self) -> None:
        await self.server.stop(grace=0)


def measure(server_name: str, port: int, args, sizes: list[int]) -> list[RoundTrip]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    client = context.Process(target=time_client, args=(f"127.0.0.1:{port}", sizes, args.iterations, args.warmup,
                                                        results))
    client.start()
    rows = [summary(server_name, *results.get(timeout=600)) for _ in range(2 * len(sizes))]
    client.join()
    return rows


def format_table(rows: list[RoundTrip]) -> str:
    lines = [f"{'server':<8} {'rpc':<7} {'sequences':>9}  {'mean us':>8}  {'p50 us':>8}  {'p99 us':>8}"]
    lines += [f"{r.server:<8} {r.rpc:<7} {r.num_sequences:>9}  {r.mean_us:>8.0f}  {r.p50_us:>8.0f}  {r.p99_us:>8.0f}"
              for r in rows]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,64,256", help="sequences per Decode request, comma-separated")
    parser.add_argument("--iterations", type=int, default=2000, help="timed round trips per size")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips per size, first")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[RoundTrip]:
    args = parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    print(machine_line("grpc_overhead"))
    print(f"# Decode round trips, unary and over one Steps channel, a sync client in its own process; "
          f"{args.iterations} round trips per size after {args.warmup} warm-up. worker: a real WorkerServer with a "
          f"no-work engine; echo: a bare grpc.aio server (the transport's floor)")
    config = loopback_config(EngineConfig(device="cpu", kv_blocks=1))
    with InProcessWorker(lambda: stub_worker_server(config)) as worker:
        rows = measure("worker", worker.server.port, args, sizes)
    with InProcessWorker(EchoServer) as echo:
        rows += measure("echo", echo.server.port, args, sizes)
    print(format_table(rows))
    return rows


def quiet_logs() -> None:
    """The worker's structlog lines go to stderr, so stdout is the table alone."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


if __name__ == "__main__":
    quiet_logs()
    main()
