"""Where a step's time goes on the GPU: the engine's decode step split into host work and device work, the
graph replay alone, the kernels of one step (torch.profiler/CUPTI, every device activity by name), and the host
functions that cost the most (cProfile). Optionally one prefill step's kernels.

Run from the repository root: python3 -m bench.gpu_profile [--shape smollm2-135m] [--batches 1,32]
"""

import argparse
import gc

import torch

from bench.gpu_attention import seconds_per_replay
from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.engine_runner import EngineRunner
from bench.phases import host_profile, log
from bench import moe_shapes
from bench.model_shapes import HYBRID_SHAPES, SHAPES, decode_step_bytes, random_checkpoint, random_tokens
from bench.moe_shapes import MOE_SHAPES
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.step import DecodeToken, PrefillSlice, Step


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES | HYBRID_SHAPES | MOE_SHAPES))
    parser.add_argument("--batches", default="1,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per measurement")
    parser.add_argument("--prefill", default="", help="one prefill case NUMxLEN to profile too; '' for none")
    parser.add_argument("--kernels", type=int, default=25, help="kernel rows to print")
    parser.add_argument("--host-rows", type=int, default=25, help="cProfile rows to print")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pdl", default="on", choices=("on", "off"),
                        help="programmatic dependent launch (off: each kernel's own time, none waiting in another's)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    shape = (SHAPES | HYBRID_SHAPES | MOE_SHAPES)[args.shape]
    batches = [int(b) for b in args.batches.split(",")]
    prefill = tuple(int(x) for x in args.prefill.lower().split("x")) if args.prefill else None
    print(gpu_machine_line("gpu_profile", "cuda"), flush=True)
    bandwidth = copy_bandwidth("cuda", 2 * 10**9)
    longest = args.context + 4 * args.steps + 8
    block = EngineConfig.kv_block_size
    kv_blocks = max(batches) * blocks_for(longest, block) + (prefill[0] * blocks_for(prefill[1], block)
                                                            if prefill else 0) + 8
    max_batch_tokens = max(8192, prefill[0] * prefill[1] if prefill else 0)
    # No prefix cache: the profiled prefill computes the same tokens as its warm-up did, every one of them.
    config = EngineConfig(device="cuda", kv_blocks=kv_blocks, max_batch_tokens=max_batch_tokens,
                          max_model_len=max(longest, prefill[1] if prefill else 0),
                          cuda_graph_batch_sizes=tuple(batches), prefix_cache=False,
                          programmatic_launch=args.pdl == "on")
    checkpoint = checkpoint_of(shape, args.seed)
    gc.collect()
    torch.cuda.empty_cache()         # a mixture's transformers model, gone
    engine, _ = build_engine(checkpoint, config)
    del checkpoint
    runner = EngineRunner(engine, max_batch_tokens)
    log(f"{args.shape}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights read at batch 1 "
        f"{step_bytes(shape, 1, 0) / 1e9:.3f} GB")

    for batch in batches:
        floor_ms = step_bytes(shape, batch, args.context) / bandwidth * 1e3
        prompts = random_tokens(batch, args.context, shape.vocab, args.seed + 3)
        first = runner.prefill(prompts)
        device_ms, host_ms = runner.time_decode(first, 5, args.steps)
        replay_ms = time_replays(engine.runner, batch, args.steps)
        step, device = median(host_ms), median(device_ms)
        print(f"## decode batch {batch}, {args.context} context: floor {floor_ms:.3f} ms")
        print(f"engine.step (host clock)  p50 {step:.3f} ms  ({step / floor_ms:.2f}x floor)")
        print(f"device time of the step   p50 {device:.3f} ms  ({device / floor_ms:.2f}x floor; inputs uploaded to "
              f"sampling done); host alone: {step - device:.3f} ms")
        print(f"graph replay alone        {replay_ms:.3f} ms  ({replay_ms / floor_ms:.2f}x floor); sampling, copies "
              f"and gaps in the step: {device - replay_ms:.3f} ms")
        tokens = tuple(DecodeToken(seq_id, token) for seq_id, token in first.items())
        print(kernel_table(lambda: runner.engine.step(Step(decode=tokens)), args.kernels))
        print(decode_profile(runner, first, args.steps, args.host_rows))
        runner.release_all()

    if prefill:
        n, length = prefill
        tokens = random_tokens(n, length, shape.vocab, args.seed + 2)
        slices = lambda: Step(prefill=tuple(PrefillSlice(i, tuple(row)) for i, row in
                                            zip(runner.new_ids(n), tokens.tolist())))
        runner.engine.step(slices())     # warm: cuBLASLt plans for these shapes
        runner.release_all()
        print(f"## prefill {n}x{length}")
        print(kernel_table(lambda: runner.engine.step(slices()), args.kernels, after=runner.release_all))


def checkpoint_of(shape, seed: int):
    """Random bf16 weights of the shape; a mixture's from transformers' own model (bench/gpu_moe.py's)."""
    if not isinstance(shape, moe_shapes.MoeShape):
        return random_checkpoint(shape, seed, "cuda")
    from bench.gpu_moe import host_checkpoint, random_hf_model
    return host_checkpoint(random_hf_model(shape, "cuda", seed), shape)


def step_bytes(shape, batch: int, context: float) -> float:
    """The floor's bytes of a decode step; a mixture's as if every token's experts were distinct (bench/gpu_moe.py
    counts the experts really routed to), an upper bound."""
    if not isinstance(shape, moe_shapes.MoeShape):
        return decode_step_bytes(shape, batch, context)
    hit = shape.layers * min(shape.experts, batch * shape.top_k)
    return moe_shapes.decode_step_bytes(shape, batch, context, hit)


def median(values):
    return sorted(values)[len(values) // 2]


def time_replays(cuda_runner, batch: int, steps: int) -> float:
    """ms per replay of the batch's decode graph on this thread's stream (stream 0), launched back to back on the stream's
    stream (device time once the queue is full)."""
    ctx = cuda_runner.stream_context
    graph, _ = ctx.graphs._graphs[batch]
    return seconds_per_replay(graph, ctx.stream, steps, warmup=3) * 1e3


def kernel_table(run_step, rows: int, after=None) -> str:
    """Device time per kernel name over 5 runs of run_step (CUPTI through torch.profiler), per run."""
    from torch.profiler import ProfilerActivity, profile
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run_step()
            if after:
                after()
        torch.cuda.synchronize()
    kernels = {}     # name -> (total us, count); every device activity (kernels and copies) of any library
    spans = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        total, count = kernels.get(event.name(), (0.0, 0))
        kernels[event.name()] = (total + event.duration_ns() / 1e3, count + 1)
        spans.append((event.start_ns(), event.start_ns() + event.duration_ns(), event.name()))
    busy = sum(t for t, _ in kernels.values()) / reps
    idle = idle_before(spans)
    lines = [f"kernels of one step: {busy / 1e3:.3f} ms busy in {sum(c for _, c in kernels.values()) // reps} "
             f"launches (durations overlap where a kernel waits for the one before, PDL); the device idle "
             f"{sum(idle.values()) / reps / 1e6:.3f} ms between them",
             f"{'us/step':>9} {'calls':>6} {'us/call':>8} {'idle us':>8}  kernel (idle: gaps before it)"]
    for name, (total, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{total / reps:9.1f} {count // reps:6d} {total / count:8.2f} {idle.get(name, 0) / reps / 1e3:8.1f}"
                     f"  {name[:110]}")
    return "\n".join(lines)


def idle_before(spans: list[tuple[int, int, str]]) -> dict[str, float]:
    """ns the device ran nothing before each kernel name started (from the end of everything before it), summed;
    the first activity's wait is not counted."""
    idle, covered = {}, None
    for start, end, name in sorted(spans):
        if covered is not None and start > covered:
            idle[name] = idle.get(name, 0) + start - covered
        covered = end if covered is None else max(covered, end)
    return idle


def decode_profile(runner: EngineRunner, first: dict, steps: int, rows: int) -> str:
    """cProfile over `steps` decode steps: the host functions by own time."""
    return ("host (cProfile, own time over all steps):\n"
            + host_profile(lambda: runner.time_decode(first, 0, steps), rows))


if __name__ == "__main__":
    from bench.grpc_overhead import quiet_logs
    quiet_logs()
    main()
