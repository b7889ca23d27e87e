"""CPU decode speed of a model (default: the embedded SmolLM2-135M), engine alone and through gRPC, against the
§6 floor: (weight bytes + KV bytes read per step) / measured memory copy bandwidth. A GGUF model runs twice, its
quantized blocks multiplied as they are and dequantized at load (--dequantize), side by side.

Run from the repository root: python -m bench.cpu_decode [--batches 1,8] [--steps 32] [--model PATH]
"""

import argparse
import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass

import torch

from bench.grpc_overhead import loopback_config, machine_line, quiet_logs
from metrale.runtime.config import EngineConfig
from metrale.runtime.default_model import default_cache_dir, fetch_default_model
from metrale.runtime.engine import Engine
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.loading import Checkpoint, load_checkpoint
from metrale.runtime.loading.gguf_blocks import BlockWeight
from metrale.runtime.own_thread import run_on_own_thread
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer
from metrale.v1 import worker_pb2 as pb


@dataclass
class DecodeRun:
    batch: int
    weights: str  # "blocks" (GGUF's quantized blocks multiplied as they are) or the dtype they were dequantized to
    path: str  # "engine" or "grpc"
    step_ms: list[float]  # per timed step, wall clock as the caller saw it
    forward_ms: list[float]  # per timed step, the engine's own forward_us


@dataclass
class Row:
    batch: int
    weights: str
    path: str
    mean_ms: float
    p50_ms: float
    forward_ms: float
    tokens_per_s: float
    floor_ms: float
    times_floor: float


def copy_bandwidth(num_bytes: int, repeats: int = 10) -> float:
    """Bytes/s of a large tensor copy, counting bytes read + bytes written (STREAM 'Copy'); best of repeats."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # faults in target's pages before timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best


def weight_bytes(engine: Engine) -> int:
    """Bytes of every weight a decode step reads whole (a quantized weight: its packed codes, scales and zeros). The
    embedding table only gives one row per token, so it counts only where it is also the (tied) lm_head; a weight
    used twice counts once."""
    weights = engine.model.weights
    tensors = [weights["lm_head"], weights["norm"]] + [t for layer in weights["layers"] for t in layer.values()]
    unique = {t.data_ptr() if isinstance(t, torch.Tensor) else id(t): t.nbytes for t in tensors}
    return sum(unique.values())


def start_worker(checkpoint: Checkpoint, engine_config: EngineConfig, dequantize: bool) -> InProcessWorker:
    """A worker with the weights in one form: GGUF's quantized blocks as they are, or dequantized at load."""
    config = loopback_config(dataclasses.replace(engine_config, dequantize=dequantize))
    return InProcessWorker(functools.partial(WorkerServer.from_checkpoint, checkpoint, config))


def weight_forms(checkpoint: Checkpoint) -> tuple[bool, ...]:
    """The dequantize settings to run: blocks then dequantized where the checkpoint has GGUF blocks, else one."""
    return (False, True) if any(isinstance(t, BlockWeight) for t in checkpoint.tensors.values()) else (True,)


def kv_bytes_per_token(engine: Engine) -> int:
    # Each layer's pool: [2 (k, v), num_blocks, kv_block_size, num_kv_heads, head_dim].
    return sum(2 * kv.shape[3] * kv.shape[4] * kv.element_size() for kv in engine.cache.layers)


def prompt_tokens(first_seq_id: int, batch: int, prompt_len: int, vocab_size: int) -> dict[int, tuple[int, ...]]:
    """seq_id -> prompt; random ids above the usual special tokens, the same in every run."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (batch, prompt_len), generator=generator)
    return {first_seq_id + i: tuple(row.tolist()) for i, row in enumerate(ids)}


class EngineDecoder:
    """Decodes a set of sequences by calling Engine.step directly, on the worker's stream thread (as its RPCs run
    there; a second thread running torch ops would keep a second OpenMP team, see metrale/runtime/own_thread.py):
    device time plus the engine's own Python, timed on that thread."""

    path = "engine"

    def __init__(self, weights: str, worker: InProcessWorker, prompts: dict[int, tuple[int, ...]]):
        self.weights, self.worker, self.engine = weights, worker, worker.engine
        out = self._on_stream(lambda: self.engine.step(Step(prefill=tuple(
            PrefillSlice(seq_id, tokens) for seq_id, tokens in prompts.items()))))
        self.next_tokens = {o.seq_id: o.token for o in out.outputs}

    def _on_stream(self, work):
        return self.worker.server.threads.submit(0, [], work).result()[0]

    def step(self) -> tuple[float, float]:
        """One decode step of every sequence; returns (wall ms, forward ms)."""
        step = Step(decode=tuple(DecodeToken(seq_id, token) for seq_id, token in self.next_tokens.items()))

        def timed():
            started = time.perf_counter()
            return self.engine.step(step), (time.perf_counter() - started) * 1e3
        out, elapsed_ms = self._on_stream(timed)
        self.next_tokens = {o.seq_id: o.token for o in out.outputs}
        return elapsed_ms, out.forward_us / 1e3

    def release(self) -> None:
        self._on_stream(lambda: self.engine.release(list(self.next_tokens)))


class GrpcDecoder:
    """Decodes a set of sequences with Decode RPCs on a loopback channel: what a client in this process sees."""

    path = "grpc"

    def __init__(self, weights: str, stub, prompts: dict[int, tuple[int, ...]]):
        self.weights, self.stub = weights, stub
        slices = [pb.PrefillSlice(seq_id=seq_id, tokens=tokens, is_last_chunk=True)
                  for seq_id, tokens in prompts.items()]
        response = stub.Prefill(pb.PrefillRequest(slices=slices))
        self.seq_ids, self.tokens = list(response.seq_ids), list(response.tokens)

    def step(self) -> tuple[float, float]:
        request = pb.DecodeRequest(seq_ids=self.seq_ids, tokens=self.tokens)
        started = time.perf_counter()
        response = self.stub.Decode(request)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self.seq_ids, self.tokens = list(response.seq_ids), list(response.tokens)
        return elapsed_ms, response.forward_us / 1e3

    def release(self) -> None:
        self.stub.Release(pb.ReleaseRequest(seq_ids=self.seq_ids))


def decode_interleaved(decoders: list, batch: int, steps: int, warmup: int) -> list[DecodeRun]:
    """Steps the decoders in turn, so load that drifts during the run falls on every path alike."""
    runs = [DecodeRun(batch, d.weights, d.path, [], []) for d in decoders]
    for i in range(warmup + steps):
        for decoder, run in zip(decoders, runs):
            elapsed_ms, forward_ms = decoder.step()
            if i >= warmup:
                run.step_ms.append(elapsed_ms)
                run.forward_ms.append(forward_ms)
    for decoder in decoders:
        decoder.release()
    return runs


def row_of(run: DecodeRun, floor_ms: float) -> Row:
    mean_ms = statistics.fmean(run.step_ms)
    return Row(run.batch, run.weights, run.path, mean_ms, statistics.median(run.step_ms),
               statistics.fmean(run.forward_ms), run.batch / mean_ms * 1e3, floor_ms, mean_ms / floor_ms)


def format_table(rows: list[Row]) -> str:
    lines = [f"{'batch':>5}  {'weights':<8}  {'path':<6}  {'ms/step':>8}  {'p50 ms':>8}  {'forward ms':>10}  "
             f"{'tokens/s':>8}  {'floor ms':>8}  {'x floor':>7}"]
    lines += [f"{r.batch:>5}  {r.weights:<8}  {r.path:<6}  {r.mean_ms:>8.1f}  {r.p50_ms:>8.1f}  "
              f"{r.forward_ms:>10.1f}  {r.tokens_per_s:>8.1f}  {r.floor_ms:>8.2f}  {r.times_floor:>7.1f}" for r in rows]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory; default: the embedded model")
    parser.add_argument("--batches", default="1,8", help="sequences decoding together, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch and path")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--copy-mb", type=int, default=512, help="size of the tensor copied to measure bandwidth")
    parser.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's choice")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    model = args.model or fetch_default_model(default_cache_dir())
    checkpoint = run_on_own_thread(lambda: load_checkpoint(model), name="load")
    max_len = args.prompt_len + args.warmup + args.steps + 1
    engine_config = EngineConfig(device="cpu", max_model_len=max_len,
                                 kv_blocks=2 * max(batches) * blocks_for(max_len, EngineConfig.kv_block_size))
    bandwidth = run_on_own_thread(lambda: copy_bandwidth(args.copy_mb << 20), name="copy")
    print(machine_line("cpu_decode"))
    # Decode step i reads prompt_len + i + 1 tokens of KV per sequence; the mean over the timed steps:
    mean_context = args.prompt_len + args.warmup + (args.steps + 1) / 2
    rows = []
    # One worker at a time (each form in turn): a second worker's stream thread would keep a second OpenMP team.
    for dequantize in weight_forms(checkpoint):
        with start_worker(checkpoint, engine_config, dequantize) as worker:
            info, engine = worker.server.servicer.info, worker.engine
            form, kv_per_token = info.dtype if dequantize else "blocks", kv_bytes_per_token(engine)
            weights = weight_bytes(engine)
            print(f"# {info.model_id}: {info.architecture}, {form}: weights read per step {weights / 1e6:.1f} MB; KV "
                  f"{kv_per_token / 1e3:.1f} kB/token; prompt {args.prompt_len} tokens, {args.steps} timed steps "
                  f"after {args.warmup} warm-up; copy bandwidth {bandwidth / 1e9:.2f} GB/s (read + write)")
            for batch in batches:
                decoders = [EngineDecoder(form, worker, prompt_tokens(0, batch, args.prompt_len, info.vocab_size)),
                            GrpcDecoder(form, worker.stub, prompt_tokens(batch, batch, args.prompt_len,
                                                                          info.vocab_size))]
                floor_ms = (weights + batch * mean_context * kv_per_token) / bandwidth * 1e3
                runs = decode_interleaved(decoders, batch, args.steps, args.warmup)
                rows += [row_of(run, floor_ms) for run in runs]
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    quiet_logs()
    main()
