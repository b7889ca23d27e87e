"""gRPC Decode round trip against a worker whose engine does no work: the API's own overhead per request.

Run from the repository root: python -m bench.grpc_overhead [--sizes 1,64,256] [--iterations 2000]
"""

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import grpc
import structlog
import torch

from bench.stub_model import stub_worker_server
from metrale.runtime.config import EngineConfig
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.v1 import worker_pb2 as pb


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
    num_sequences: int
    mean_us: float
    p50_us: float
    p99_us: float


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


def time_decode(stub, num_sequences: int, iterations: int, warmup: int) -> RoundTrip:
    request = pb.DecodeRequest(seq_ids=range(num_sequences), tokens=[0] * num_sequences)
    for _ in range(warmup):
        stub.Decode(request)
    times_us = []
    for _ in range(iterations):
        started = time.perf_counter_ns()
        response = stub.Decode(request)
        times_us.append((time.perf_counter_ns() - started) / 1e3)
        if len(response.tokens) != num_sequences:
            raise RuntimeError(f"Decode of {num_sequences} sequences returned {len(response.tokens)} tokens")
    times_us.sort()
    return RoundTrip(num_sequences, statistics.fmean(times_us), percentile(times_us, 0.50), percentile(times_us, 0.99))


def format_table(rows: list[RoundTrip]) -> str:
    lines = [f"{'sequences':>9}  {'mean us':>8}  {'p50 us':>8}  {'p99 us':>8}  {'us/seq (p50)':>12}"]
    lines += [f"{r.num_sequences:>9}  {r.mean_us:>8.0f}  {r.p50_us:>8.0f}  {r.p99_us:>8.0f}  "
              f"{r.p50_us / r.num_sequences:>12.2f}" for r in rows]
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
    print(f"# Decode through a real WorkerServer with a no-work engine, sync client in the same process, "
          f"{args.iterations} round trips per size after {args.warmup} warm-up")
    config = loopback_config(EngineConfig(device="cpu", kv_blocks=1))
    with InProcessWorker(lambda: stub_worker_server(config)) as worker:
        rows = [time_decode(worker.stub, n, args.iterations, args.warmup) for n in sizes]
    print(format_table(rows))
    return rows


def quiet_logs() -> None:
    """The worker's structlog lines go to stderr, so stdout is the table alone."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


if __name__ == "__main__":
    quiet_logs()
    main()
