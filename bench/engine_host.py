"""The host's share of a decode step, without a device: the real engine (sequence table, planner, reservations,
run-ahead's guess chain, rounds) and the CUDA backend's host work a step (the decode graph's metadata image, packed
ahead where staged; the sampling parameters; the outputs read back) over an emulated device, a stream whose every
forward takes the step time given (--device-ms). Timed on the engine alone, as a stream's thread steps it, and
through a real WorkerServer driven over one Steps channel by a client in its own process, as a gateway would; with
the device's idle time between steps, the wait for the host that run-ahead must hide.

python -m bench.engine_host [--batches 1,64,256] [--device-ms 4.46,8.09,17.42] [--context 1024] [--steps 200]
    [--profile 25]
"""

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np

from bench.grpc_client import decode_round_trips_in_subprocess
from bench.grpc_overhead import loopback_config, machine_line, quiet_logs
from bench.engine_runner import EngineRunner
from bench.model_shapes import SHAPES, random_checkpoint, random_tokens
from bench.phases import host_profile
from metrale.runtime.backend.cuda.batch import metadata_elements, pack_batch, set_tokens
from metrale.runtime.backend.cuda.graphs import decode_bucket
from metrale.runtime.backend.cuda.kernels.sampling import pack_sampling_params
from metrale.runtime.backend.cuda.sampler import OUT_WORDS, Wanted, read_outputs
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.build import build_engine
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.config import EngineConfig
from metrale.runtime.engine import Engine
from metrale.runtime.sampling import SampleResult
from metrale.runtime.step import DecodeToken, Step
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer, freeze_heap

GRAPH_SIZES = EngineConfig().cuda_graph_batch_sizes
# The last seconds of an emulated wait spent spinning (yielding the interpreter lock at each turn).
SPIN_S = 2e-3


class EmulatedDevice:
    """One stream's device time, emulated: a forward queued at t starts when the one before it has ended (or at t)
    and takes step_ms; its sampling is done when it ends. The idle time between one forward's end and the next
    one's start is kept per launch (the gap run-ahead must hide)."""

    def __init__(self, step_ms: float = 0.0):
        self.step_s = step_ms / 1e3
        self.busy_until = 0.0
        self.idle_ms: list[float] = []

    def launch(self) -> float:
        """Queues a forward; when it will be done."""
        now = time.perf_counter()
        if self.busy_until:
            self.idle_ms.append(max(0.0, now - self.busy_until) * 1e3)
        self.busy_until = max(now, self.busy_until) + self.step_s
        return self.busy_until

    @staticmethod
    def wait(done_at: float) -> None:
        """Until done_at, the interpreter lock free as in a stream synchronize: a sleep, then a spin for its last
        SPIN_S, as CUDA's synchronize spins (a sleep alone wakes 0.1-0.9 ms late, and a thread woken from one runs
        its next microseconds cold)."""
        while (left := done_at - time.perf_counter()) > 0:
            time.sleep(left - SPIN_S if left > SPIN_S + 1e-4 else 0)


class InstantRunner:
    """A runner over an EmulatedDevice, doing the CUDA runner's host work: a forward's metadata image (pack_batch,
    padded to its decode graph's bucket; a staged batch only gets its tokens set) and its copy, the sampling
    parameters (pack_sampling_params) and a result read from a zeroed outputs image (every token 0). The cache and
    memory plan are the CPU runner's it wraps; the model's forward is never called."""

    concurrent_forwards = queues_work = runs_ahead_by_default = True
    supports_beam = prefill_graphs = False
    device_errors = ()

    def __init__(self, runner, max_batch_tokens: int, max_seqs: int, max_blocks: int):
        self.runner, self.device, self.dtype, self.kv_dtypes = runner, runner.device, runner.dtype, runner.kv_dtypes
        self.region = DeviceTensor(0, (metadata_elements(max_batch_tokens, max_seqs, max_blocks),), "int32")
        self.max_blocks = max_blocks
        self.decode_graph_rows = GRAPH_SIZES[-1]
        self.packed_pairs: dict = {}
        self.upload = np.zeros(self.region.numel, dtype=np.int32)     # the pinned copy's source, as the H2D copy
        self.emulated = EmulatedDevice()

    def bind_stream(self, stream: int) -> None:
        pass

    def synchronize(self) -> None:
        self.emulated.wait(self.emulated.busy_until)

    def counters(self) -> dict[str, int]:
        return self.runner.counters()

    def stage(self, batch) -> None:
        if size := decode_bucket(batch, GRAPH_SIZES):
            batch.staged = (size, pack_batch(batch, self.region, self.max_blocks, pad_to=size))

    def run_forward(self, forward, batch, replayable: bool) -> float:
        """When the forward's emulated device time ends (the 'logits' queue_sample takes)."""
        size = decode_bucket(batch, GRAPH_SIZES) or 0
        if batch.staged is not None and batch.staged[0] == size:
            prepared = batch.staged[1]
            set_tokens(prepared, batch.token_ids)
        else:
            prepared = pack_batch(batch, self.region, self.max_blocks, pad_to=size)
        self.upload[:prepared.host.size] = prepared.host
        done_at = self.emulated.launch()
        if not len(batch.sample_rows):
            self.emulated.wait(done_at)
        return done_at

    def queue_sample(self, done_at: float, rows) -> "InstantSample":
        pack_sampling_params(rows, self.packed_pairs)
        return InstantSample(rows, done_at)


class InstantSample:
    """A queued sampling whose outputs image is zeros (every token 0): read back, once the emulated forward is done,
    by the CUDA sampler's own conversion."""

    def __init__(self, rows, done_at: float):
        self.wanted, self.done_at = Wanted(rows), done_at

    def result(self) -> SampleResult:
        EmulatedDevice.wait(self.done_at)
        return read_outputs(np.zeros(self.wanted.num_rows * OUT_WORDS, dtype=np.int32), self.wanted)


def instant_engine(max_batch: int, context: int, steps: int) -> tuple[Engine, object]:
    """An engine over the tiny Llama shape, its cache large enough for max_batch sequences of context + steps
    tokens, running ahead on an InstantRunner; and its ModelInfo."""
    max_len = 1 << max(12, (context + steps + 64).bit_length())
    shape = dataclasses.replace(SHAPES["tiny"], max_positions=max_len)
    config = EngineConfig(device="cpu", kv_blocks=max_batch * (blocks_for(context + steps, 16) + 4) + 64,
                          max_model_len=max_len, cuda_graph_batch_sizes=(), run_ahead="on")
    cpu, info = build_engine(random_checkpoint(shape), config)
    runner = InstantRunner(cpu.runner, config.max_batch_tokens, config.max_seqs, blocks_for(max_len, 16))
    return Engine(cpu.model, runner, cpu.cache, config, max_len), dataclasses.replace(info, device="instant")


@dataclass
class Row:
    path: str
    batch: int
    device_ms: float
    step_ms: list[float]
    idle_ms: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def p99(self) -> float:
        ordered = sorted(self.step_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    @property
    def host_share(self) -> float:
        """The step's time beyond the device's, as a share of the step: what issue 26's 5% bounds."""
        return (self.p50 - self.device_ms) / self.p50


class EngineLoop:
    """A gateway's decode loop on the engine itself, as a stream's thread steps it: each step fed the last one's
    tokens; the guess it returns (queued already: the device runs it while the answer travels) then run, which
    reserves and stages its successor and waits for its outputs, and the next step takes it."""

    def __init__(self, engine: Engine, prefilled: dict[int, int]):
        """prefilled: the sequences' ids and sampled tokens (EngineRunner.prefill)."""
        self.engine, self.ids = engine, list(prefilled)
        self.request = Step(decode=tuple(map(DecodeToken, self.ids, prefilled.values())))

    def step(self) -> None:
        out = self.engine.step(self.request, run_ahead=True)
        self.request = Step(decode=tuple(map(DecodeToken, self.ids, (o.token for o in out.outputs))))
        if out.ahead is not None:
            out.ahead.run(lambda: None)

    def time(self, warmup: int, steps: int) -> list[float]:
        times = []
        for i in range(warmup + steps):
            started = time.perf_counter()
            self.step()
            if i >= warmup:
                times.append((time.perf_counter() - started) * 1e3)
        return times

    def release(self) -> None:
        self.engine.release(self.ids)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--device-ms", default="0",
                        help="the emulated device's step time per batch, comma-separated (one value: every batch); "
                             "Llama-3-8B on the H200 at 1k: 4.46,8.09,17.42")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per batch and path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N functions of the engine's steps")
    parser.add_argument("--skip-grpc", action="store_true")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device_ms = [float(d) for d in args.device_ms.split(",")]
    device_ms = dict(zip(batches, device_ms if len(device_ms) > 1 else device_ms * len(batches), strict=True))
    print(machine_line("engine_host"), flush=True)
    engine, info = instant_engine(max(batches), args.context, 2 * (args.warmup + args.steps) + 8)
    freeze_heap()       # as serve does once the worker is loaded
    emulate = lambda batch: setattr(engine.runner, "emulated", EmulatedDevice(device_ms[batch]))  # noqa: E731
    rows, prompts = [], EngineRunner(engine, engine.config.max_batch_tokens)
    for batch in batches:
        loop = EngineLoop(engine, prompts.prefill(random_tokens(batch, args.context, SHAPES["tiny"].vocab, batch)))
        emulate(batch)
        times = loop.time(args.warmup, args.steps)
        rows.append(Row("engine", batch, device_ms[batch], times, engine.runner.emulated.idle_ms[-args.steps:]))
        if args.profile:
            print(f"# profile, engine, batch {batch}, {args.steps} steps:\n"
                  + host_profile(lambda: loop.time(0, args.steps), args.profile), flush=True)
        loop.release()
    if not args.skip_grpc:
        config = loopback_config(engine.config)
        with InProcessWorker(lambda: WorkerServer(engine, info, None, config)) as worker:
            for batch in batches:
                emulate(batch)
                trips = decode_round_trips_in_subprocess(worker.address, batch, args.context, args.steps,
                                                         args.warmup, SHAPES["tiny"].vocab, rpc="steps")
                rows.append(Row("gRPC", batch, device_ms[batch], [trip[0] for trip in trips],
                                engine.runner.emulated.idle_ms[-args.steps - 1:-1]))
    print(f"# engine_host: the tiny Llama shape's engine over an emulated device (a step's time as given, the CUDA "
          f"runner's host work done), {args.context}-token contexts, {args.steps} timed decode steps after "
          f"{args.warmup}; engine: Engine.step and its guess on this thread; gRPC: a Steps channel's round trip from "
          f"a client process. host share: (p50 - device) / p50; idle: the device's wait between steps")
    print(f"{'path':<7} {'batch':>5}  {'device ms':>9}  {'p50 ms':>7}  {'p99 ms':>7}  {'host share':>10}  "
          f"{'idle p50 ms':>11}")
    for r in rows:
        idle = statistics.median(r.idle_ms) if r.idle_ms else float("nan")
        print(f"{r.path:<7} {r.batch:>5}  {r.device_ms:>9.2f}  {r.p50:>7.3f}  {r.p99:>7.3f}  {r.host_share:>10.1%}  "
              f"{idle:>11.3f}")
    return rows


if __name__ == "__main__":
    quiet_logs()
    main()
