"""Serving benchmark: the reference gateway (examples/gateway) and a worker under synthetic requests, Poisson
arrivals at several rates: throughput, time to first token and inter-token latency (p50, p99) per rate; and the
gateway's own cost at saturation: a batch of requests sent at once, all decoding, its output tokens/s while every one
of them decodes (from the last first token to the first finish) against what the worker's step benchmark gives at
that batch and context (Decode steps on one Steps stream from a client process).

Input and output lengths are drawn from log-normal distributions (medians and spreads set by flags; the defaults are
those of chat traces such as ShareGPT's, clipped to the model's length). The worker runs in this process; the
gateway and the load generator in a process of their own, as a deployment would have them.

Run from the repository root: python3 -m bench.serving [--shape llama-3-8b --device cuda] [--rates 1,4,16,inf]
"""

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

from bench.grpc_client import decode_round_trips, run_spawned
from bench.grpc_overhead import loopback_config, machine_line, quiet_logs
from bench.grpc_overhead import percentile as nearest_rank
from bench.model_shapes import SHAPES, random_checkpoint
from metrale.runtime.config import EngineConfig
from metrale.runtime.default_model import default_cache_dir, fetch_default_model
from metrale.runtime.loading import load_checkpoint
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer

GATEWAY = Path(__file__).resolve().parents[1] / "examples" / "gateway"


def lengths(rng: random.Random, count: int, median: float, sigma: float, low: int, high: int) -> list[int]:
    return [min(high, max(low, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(count)]


def percentile(values: list, fraction: float) -> float:
    """grpc_overhead.percentile of any list (nan where it is empty)."""
    return nearest_rank(sorted(values), fraction) if values else float("nan")


async def started_gateway(address: str, chunk_tokens: int):
    """The reference gateway (examples/gateway) over the worker at address, started; and its Completion type."""
    sys.path.insert(0, str(GATEWAY))
    from metrale_gateway.router import Gateway
    from metrale_gateway.scheduler import Completion

    gateway = Gateway([address], chunk_tokens)
    await gateway.start()
    return gateway, Completion


async def drive(address: str, requests: list[tuple[list[int], int]], rate: float, chunk_tokens: int) -> dict:
    """The requests through one gateway, arriving as a Poisson process of `rate` a second (inf: all at once)."""
    gateway, Completion = await started_gateway(address, chunk_tokens)
    rng = random.Random(1)
    ttft, itl, e2e, generated = [], [], [], 0
    batches: list[int] = []
    scheduler_steps = gateway.schedulers[gateway.links[0]]

    async def one(prompt: list[int], max_tokens: int, delay: float) -> None:
        nonlocal generated
        await asyncio.sleep(delay)
        start = last = time.perf_counter()
        first = True
        async for _ in gateway.generate(Completion(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)):
            now = time.perf_counter()
            (ttft if first else itl).append((now - last) * 1e3)
            first, last = False, now
            generated += 1
        e2e.append((time.perf_counter() - start) * 1e3)

    async def sample_batches() -> None:
        while True:
            batches.append(sum(len(s._running) for s in scheduler_steps))
            await asyncio.sleep(0.01)

    delays, t = [], 0.0
    for _ in requests:
        delays.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    sampler = asyncio.create_task(sample_batches())
    began = time.perf_counter()
    await asyncio.gather(*(one(p, n, d) for (p, n), d in zip(requests, delays)))
    elapsed = time.perf_counter() - began
    sampler.cancel()
    await gateway.stop()
    busy = [b for b in batches if b]
    return {"rate": rate, "requests": len(requests), "seconds": elapsed, "output_tokens": generated,
            "tokens_per_s": generated / elapsed, "requests_per_s": len(requests) / elapsed,
            "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            "itl_p50_ms": percentile(itl, 0.5), "itl_p99_ms": percentile(itl, 0.99),
            "e2e_p50_ms": percentile(e2e, 0.5), "mean_running": statistics.fmean(busy) if busy else 0.0}


async def saturate(address: str, batch: int, prompt_len: int, max_tokens: int, chunk_tokens: int, vocab: int
                   ) -> dict:
    """`batch` requests of prompt_len tokens and max_tokens outputs sent at once: the gateway's output tokens/s
    while all of them decode, from the last first token to the first finish."""
    gateway, Completion = await started_gateway(address, chunk_tokens)
    rng = random.Random(2)
    firsts, finishes, times = [], [], []

    async def one() -> None:
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        first = True
        async for _ in gateway.generate(Completion(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)):
            now = time.perf_counter()
            times.append(now)
            if first:
                firsts.append(now)
                first = False
        finishes.append(time.perf_counter())

    await asyncio.gather(*(one() for _ in range(batch)))
    await gateway.stop()
    start, end = max(firsts), min(finishes)
    inside = sum(start < t <= end for t in times)
    return {"batch": batch, "prompt": prompt_len, "max_tokens": max_tokens, "window_s": end - start,
            "tokens_in_window": inside, "tokens_per_s": inside / (end - start) if end > start else 0.0}


def load_and_steps(address, requests, rates, chunk_tokens, vocab, step_steps, saturation) -> dict:
    """Every rate through the gateway; then a batch sent at once, and the step benchmark at that batch."""
    rows = [asyncio.run(drive(address, requests, rate, chunk_tokens)) for rate in rates]
    batch, prompt_len, max_tokens = saturation
    saturated = asyncio.run(saturate(address, batch, prompt_len, max_tokens, chunk_tokens, vocab))
    context = prompt_len + max_tokens // 2
    step_ms = statistics.median(decode_round_trips(address, batch, context, step_steps, 4, vocab, 3, rpc="steps"))
    return {"rows": rows, "saturated": saturated,
            "step": {"batch": batch, "context": context, "step_ms": step_ms, "tokens_per_s": batch / step_ms * 1e3}}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'rate/s':>7} {'reqs':>5} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'ITL p50':>8} {'ITL p99':>8} {'running':>8}"]
    for r in rows:
        lines.append(f"{r['rate']:>7} {r['requests']:>5} {r['tokens_per_s']:>10.1f} {r['requests_per_s']:>7.2f} "
                     f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} {r['itl_p50_ms']:>8.2f} "
                     f"{r['itl_p99_ms']:>8.2f} {r['mean_running']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory; default: the embedded model")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rates", default="2,8,inf", help="arrivals a second, comma-separated; inf: all at once")
    parser.add_argument("--saturation", default="64x128x256",
                        help="BATCHxPROMPTxOUTPUT: that many requests sent at once, each of PROMPT tokens and OUTPUT "
                             "outputs: the gateway's tokens/s while all decode, against the step benchmark")
    parser.add_argument("--requests", type=int, default=64, help="requests a rate")
    parser.add_argument("--input", default="256,1.0", help="median,sigma of the prompts' log-normal lengths")
    parser.add_argument("--output", default="128,0.8", help="median,sigma of the outputs' log-normal lengths")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--kv-blocks", type=int, default=None, help="default: room for every request at once")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prompt tokens a gateway step sends at most")
    parser.add_argument("--step-steps", type=int, default=32, help="timed steps of the step benchmark")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    print(machine_line("serving"))
    checkpoint = (random_checkpoint(SHAPES[args.shape], 0, args.device) if args.shape
                  else load_checkpoint(args.model or fetch_default_model(default_cache_dir())))
    rng = random.Random(0)
    (in_median, in_sigma), (out_median, out_sigma) = ((float(v) for v in s.split(",")) for s in (args.input,
                                                                                                 args.output))
    outputs = lengths(rng, args.requests, out_median, out_sigma, 1, args.max_model_len // 2)
    inputs = [min(n, args.max_model_len - o) for n, o in zip(
        lengths(rng, args.requests, in_median, in_sigma, 4, args.max_model_len), outputs)]
    saturation = tuple(int(v) for v in args.saturation.split("x"))
    # room for every request at once, and for the saturation batch
    blocks = args.kv_blocks or max(sum(-(-(i + o) // EngineConfig.kv_block_size) for i, o in zip(inputs, outputs)),
                                   saturation[0] * -(-(saturation[1] + saturation[2]) // EngineConfig.kv_block_size)
                                   ) + 64
    worker = InProcessWorker(lambda: WorkerServer.from_checkpoint(checkpoint, loopback_config(EngineConfig(
        device=args.device, kv_blocks=blocks, max_model_len=args.max_model_len, max_seqs=args.max_seqs,
        max_batch_tokens=args.max_batch_tokens))))
    try:
        from metrale.v1 import worker_pb2 as pb
        info = worker.stub.Info(pb.InfoRequest())
        vocab = info.vocab_size
        requests = [([rng.randrange(3, vocab) for _ in range(i)], o) for i, o in zip(inputs, outputs)]
        print(f"# {info.model_id}: {info.architecture} {info.dtype} on {info.device}; {args.requests} requests a "
              f"rate, prompts median {statistics.median(inputs)} tokens (p99 {percentile(inputs, 0.99)}), outputs "
              f"median {statistics.median(outputs)} (p99 {percentile(outputs, 0.99)}); gateway in its own process")
        rates = [float(r) for r in args.rates.split(",")]
        result = run_spawned(load_and_steps, (worker.address, requests, rates, args.chunk_tokens, vocab,
                                              args.step_steps, saturation), args.timeout, "the load generator")
    finally:
        worker.stop()
    print(format_table(result["rows"]))
    step, saturated = result["step"], result["saturated"]
    print(f"# at saturation: {saturated['batch']} requests of {saturated['prompt']} prompt tokens sent at once, "
          f"{saturated['tokens_per_s']:.1f} output tokens/s through the gateway while all decode "
          f"({saturated['tokens_in_window']} tokens in {saturated['window_s']:.2f} s); the step benchmark at batch "
          f"{step['batch']} and {step['context']}-token contexts: {step['step_ms']:.2f} ms a step, "
          f"{step['tokens_per_s']:.1f} tokens/s ({saturated['tokens_per_s'] / step['tokens_per_s']:.2f}x)")
    out = {"args": vars(args), **result}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    quiet_logs()
    main()
