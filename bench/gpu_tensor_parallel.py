"""Tensor parallel on the CUDA backend, end to end: a Llama-shaped model with random weights split over each count of
ranks (rank 0 in this process behind a WorkerServer, the others spawned as `serve --tensor-parallel` spawns them,
each drawing the same weights: model_shapes.drawn_checkpoint); decode through gRPC (a client process, one Steps
stream) and on the engine (rank 0's device events), and prefill on the engine; against the per-GPU floor (one rank's
weights and KV over one GPU's copy bandwidth) and the speed-up over the fewest ranks run; and the share of rank 0's
decode step its NCCL kernels take (CUPTI through torch.profiler: the sums and the logits' gather, waits for the other
ranks included).

Run from the repository root: python3 -m bench.gpu_tensor_parallel [--shape llama3-8b] [--ranks 1,2] [--batches 1,64]
"""

import argparse
import dataclasses
import gc
import multiprocessing

import torch

from bench.decode_tables import DecodeRow, PrefillRow, row_record
from bench.engine_runner import EngineRunner
from bench.gpu_ceilings import copy_bandwidth, gemm_rate, gpu_machine_line
from bench.gpu_decode import decode_engine_row, decode_grpc_row, write_json
from bench.model_shapes import SHAPES, drawn_checkpoint, kv_bytes_per_token, layer_matmul_params, prefill_flops, \
    random_tokens
from bench.phases import Run, add_decode_options, add_run_options, log
from bench.prefill_cases import parse_prefill_cases
from metrale.runtime.build import build_engine, build_follower
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.config import EngineConfig
from metrale.runtime.parallel.follower import follow
from metrale.runtime.parallel.group import GlooGroup, Shard
from metrale.runtime.parallel.launch import free_address
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_options(parser, SHAPES, "llama3-8b", "1,64", steps=32, warmup=5)
    parser.add_argument("--ranks", default="1,2", help="rank counts to run, comma-separated")
    parser.add_argument("--prefill", default="1x4096", help="prefill cases NUMxLEN, comma-separated; '' for none")
    parser.add_argument("--prefill-reps", type=int, default=5, help="timed prefills per case")
    parser.add_argument("--prefill-warmup", type=int, default=2, help="untimed prefills first")
    parser.add_argument("--profile-steps", type=int, default=5, help="decode steps profiled for the NCCL share")
    add_run_options(parser)
    return parser.parse_args(argv)


@dataclasses.dataclass
class RankedRow:
    """A decode row (DecodeRow) or a prefill row (PrefillRow: its FLOPs and GEMM rate a GPU's) at a count of ranks;
    a decode row's NCCL share where profiled."""
    ranks: int
    row: "DecodeRow | PrefillRow"
    nccl_share: float | None = None


def rank_step_bytes(shape, ranks: int, batch: int, context: float) -> float:
    """The bytes one rank's decode step must move at the least: its part of every layer's matrices (the norms
    whole), the final norm, its part of the vocab projection, and its KV heads' part of each sequence's KV."""
    per_layer = layer_matmul_params(shape) / ranks + 2 * shape.hidden
    head = -(-shape.vocab // ranks) * shape.hidden
    kv_share = max(1, shape.kv_heads // ranks) / shape.kv_heads
    return 2 * (shape.layers * per_layer + shape.hidden + head) + batch * context * kv_bytes_per_token(shape) * kv_share


def follow_drawn(shape_name: str, seed: int, config: EngineConfig, rank: int, size: int, address: str) -> None:
    """A rank other than 0 (a spawned process): its shard of the drawn weights, following rank 0's calls."""
    group = GlooGroup(Shard(rank, size), address)
    model, runner, specs = build_follower(drawn_checkpoint(SHAPES[shape_name], seed, _generate_on(config, rank)),
                                          config, group)
    follow(group, model, runner, specs)
    group.close()


def _generate_on(config: EngineConfig, rank: int) -> str:
    """Where a rank draws its weights: its own GPU (CUDA's generator gives the same numbers on any), else the CPU."""
    return f"cuda:{rank}" if config.device == "cuda" else "cpu"


def start_worker(args, ranks: int, config: EngineConfig) -> InProcessWorker:
    """Rank 0's engine (its followers spawned first, where ranks > 1) behind a WorkerServer on loopback; stopping
    the worker stops the ranks."""
    followers, group = [], None
    if ranks > 1:
        address = free_address()
        context = multiprocessing.get_context("spawn")
        followers = [context.Process(target=follow_drawn, args=(args.shape, args.seed, config, rank, ranks, address),
                                     name=f"metrale-rank-{rank}", daemon=True) for rank in range(1, ranks)]
        for follower in followers:
            follower.start()
        group = GlooGroup(Shard(0, ranks), address)
    try:
        engine, info = build_engine(drawn_checkpoint(SHAPES[args.shape], args.seed, _generate_on(config, 0)), config,
                                    group=group)
    except BaseException:
        for follower in followers:
            follower.terminate()
        raise
    server_config = WorkerConfig(host="127.0.0.1", port=0, reflection=False, drain_timeout=5.0, engine=config,
                                 tensor_parallel=ranks)
    return InProcessWorker(lambda: WorkerServer(engine, info, None, server_config, followers))


def nccl_share(ours: EngineRunner, first: dict, steps: int) -> float:
    """The share of rank 0's device time in `steps` decode steps that NCCL's kernels take (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours.time_decode(first, 0, steps)
        torch.cuda.synchronize()
    busy = nccl = 0
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            busy += event.duration_ns()
            nccl += event.duration_ns() if event.name().startswith("nccl") else 0
    return nccl / busy if busy else float("nan")


def measure_ranks(run: Run, args, ranks: int, config: EngineConfig, bandwidth: float, gemm: float, checked: dict
                  ) -> list[RankedRow]:
    """checked: each rank count's last logits of the check prompts, and their relative error against the first
    count's (the same model, however split)."""
    shape, rows = SHAPES[args.shape], []
    worker, note = run.phase(f"{ranks} rank(s): build", start_worker, args, ranks, config)
    if worker is None:
        return [RankedRow(ranks, DecodeRow(batch, "metrale", float("nan"), note=note)) for batch in args.batch_list]
    ours = EngineRunner(worker.engine, config.max_batch_tokens)
    try:
        logits, _ = run.phase(f"{ranks} rank(s): check logits", ours.last_logits,
                              random_tokens(2, min(64, args.context), shape.vocab, args.seed + 1))
        if logits is not None:
            first = checked.setdefault("logits", logits)
            checked.setdefault("errors", {})[ranks] = float((logits - first).norm() / first.norm())
            log(f"{ranks} rank(s): check prompts' last logits against {min(checked['errors'])} rank(s)': relative "
                f"error {checked['errors'][ranks]:.2e}")
        for n, length in args.cases:
            tokens = random_tokens(n, length, shape.vocab, args.seed + 5)
            row = PrefillRow(n, length, "metrale", prefill_flops(shape, n, length) / ranks, gemm)
            times, row.note = run.phase(f"{ranks} rank(s): prefill {row.label}", ours.time_prefill, tokens,
                                        args.prefill_warmup, args.prefill_reps)
            row.step_ms = times or []
            if times:
                log(f"{ranks} rank(s): prefill {row.label} p50 {row.p50_ms:.1f} ms, {row.tflops:.1f} TFLOP/s a GPU "
                    f"({row.fraction_of_gemm:.2f} of the GEMM rate)")
            rows.append(RankedRow(ranks, row))
        mean_context = args.context + args.warmup + (args.steps + 1) / 2
        for batch in args.batch_list:
            floor_ms = rank_step_bytes(shape, ranks, batch, mean_context) / bandwidth * 1e3
            prompts = random_tokens(batch, args.context, shape.vocab, args.seed + 3)
            engine_row = RankedRow(ranks, decode_engine_row(run, args, ours, batch, prompts, floor_ms))
            if args.device == "cuda" and ranks > 1 and engine_row.row.ok:
                first = ours.prefill(prompts)
                share, _ = run.phase(f"{ranks} rank(s): NCCL share at {batch}", nccl_share, ours, first,
                                     args.profile_steps)
                ours.release_all()
                engine_row.nccl_share = share
            rows.append(engine_row)
            if not args.skip_grpc:
                rows.append(RankedRow(ranks, decode_grpc_row(run, args, worker, shape, batch, floor_ms, rpc="steps")))
    finally:
        worker.stop()
    return rows


def format_tables(rows: list[RankedRow]) -> str:
    """Decode: p50 ms, x floor (a rank's bytes over one GPU's copy bandwidth), speed-up over the fewest ranks' p50
    of the same impl and batch, NCCL's share of rank 0's device time. Prefill: p50 ms, TFLOP/s a GPU and its share
    of one GPU's GEMM rate, speed-up likewise."""
    fewest = {}
    for r in rows:
        if r.row.ok:
            fewest.setdefault(_key(r.row), r)

    def speed_up(r):
        base = fewest.get(_key(r.row))
        return f"{base.row.p50_ms / r.row.p50_ms:.2f}" if base and base.ranks != r.ranks else "-"
    decode = [f"{'ranks':>5}  {'impl':<8}  {'batch':>5}  {'p50 ms':>8}  {'floor ms':>8}  {'x floor':>7}  "
              f"{'speed-up':>8}  {'NCCL %':>6}"]
    prefill = [f"{'ranks':>5}  {'prompts':<10}  {'p50 ms':>9}  {'TFLOP/s':>8}  {'x GEMM':>6}  {'speed-up':>8}"]
    for r in rows:
        row = r.row
        if isinstance(row, PrefillRow):
            times = (f"{row.p50_ms:>9.1f}  {row.tflops:>8.1f}  {row.fraction_of_gemm:>6.2f}  {speed_up(r):>8}"
                     if row.ok else f"{'-':>9}  {'-':>8}  {'-':>6}  {'-':>8}  {row.note}")
            prefill.append(f"{r.ranks:>5}  {row.label:<10}  {times}")
            continue
        share = f"{100 * r.nccl_share:.1f}" if r.nccl_share is not None else "-"
        times = (f"{row.p50_ms:>8.3f}  {row.floor_ms:>8.3f}  {row.times_floor:>7.2f}  {speed_up(r):>8}  {share:>6}"
                 if row.ok else f"{'-':>8}  {row.floor_ms:>8.3f}  {'-':>7}  {'-':>8}  {'-':>6}  {row.note}")
        decode.append(f"{r.ranks:>5}  {row.impl:<8}  {row.batch:>5}  {times}")
    return "\n".join(decode + ([""] + prefill if len(prefill) > 1 else []))


def _key(row) -> tuple:
    return ("prefill", row.label) if isinstance(row, PrefillRow) else (row.impl, row.batch)


def main(argv: list[str] | None = None) -> tuple[list[RankedRow], dict[int, float]]:
    args = parse_args(argv)
    device = args.device
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.cases = parse_prefill_cases(args.prefill) if args.prefill else []
    rank_counts = [int(r) for r in args.ranks.split(",")]
    if device == "cuda" and torch.cuda.device_count() < max(rank_counts):
        raise SystemExit(f"--ranks {args.ranks}: {torch.cuda.device_count()} GPUs visible")
    run = Run(args.time_budget, device)
    print(gpu_machine_line("gpu_tensor_parallel", device), flush=True)
    bandwidth, _ = run.phase("copy bandwidth", copy_bandwidth, device, args.copy_mb * 10**6)
    gemm, _ = run.phase("GEMM rate", gemm_rate, device, args.gemm_size)
    if bandwidth is None or gemm is None:
        raise SystemExit(f"the ceilings could not be measured: {run.errors}")
    if device == "cuda":
        torch.cuda.empty_cache()
    decode_len = args.context + args.warmup + args.steps
    longest = max([decode_len] + [length for _, length in args.cases])
    max_batch_tokens = max([8192] + [n * length for n, length in args.cases])
    kv_blocks = max([max(args.batch_list) * blocks_for(decode_len, EngineConfig.kv_block_size)]
                    + [n * blocks_for(length, EngineConfig.kv_block_size) for n, length in args.cases]) + 8
    config = EngineConfig(device=device, kv_blocks=kv_blocks, max_batch_tokens=max_batch_tokens,
                          max_seqs=max(64, max(args.batch_list)), max_model_len=longest, prefix_cache=False)
    log(f"{args.shape}: copy bandwidth {bandwidth / 1e12:.3f} TB/s a GPU, bf16 GEMM {gemm / 1e12:.1f} TFLOP/s; "
        f"{config}")
    rows, checked = [], {}
    for ranks in rank_counts:
        rows += measure_ranks(run, args, ranks, config, bandwidth, gemm, checked)
        gc.collect()
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "cases"}, "phases": run.phases,
                           "errors": run.errors, "check_errors": checked.get("errors", {}),
                           "rows": [{"ranks": r.ranks, "nccl_share": r.nccl_share, **row_record(r.row)}
                                    for r in rows]})
    print(f"# {args.shape}, random bf16 weights; decode: {args.context}-token contexts, {args.steps} timed steps; "
          f"metrale: rank 0's device time (CUDA events), steps: a client process's round trip on one Steps stream; "
          f"floor = one rank's weights and KV / one GPU's copy bandwidth {bandwidth / 1e12:.3f} TB/s; prefill: engine "
          f"wall per step; NCCL %: NCCL's kernels' share of rank 0's device time in decode steps")
    print(format_tables(rows))
    errors = checked.get("errors", {})
    print(f"# check: 2 prompts' last logits at each rank count against {rank_counts[0]} rank(s)': relative error "
          + ", ".join(f"{ranks} ranks {error:.2e}" for ranks, error in errors.items())
          + ("" if all(e < 5e-2 for e in errors.values()) else "  WARNING: not the same model?"))
    print(run.summary())
    return rows, errors


if __name__ == "__main__":
    from bench.grpc_overhead import quiet_logs
    quiet_logs()
    main()
