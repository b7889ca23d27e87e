"""GPU decode and prefill of a random bf16 Llama (default: the Llama-3-8B shape), the engine next to the peer of
issue 3 (bench/peer_llama.py: plain PyTorch, static KV cache, torch.compile(mode="reduce-overhead")), against the
§6 ceilings measured in the same run: copy bandwidth (decode floor) and the bf16 GEMM rate (prefill).

Run from the repository root: python3 -m bench.gpu_decode [--shape llama3-8b] [--batches 1,8,32,64,128,256]
"""

import argparse
import dataclasses
import gc
import json
import os
import sys

import torch

from bench.decode_tables import DecodeRow, format_decode_table, format_prefill_table, row_record
from bench.engine_runner import EngineRunner
from bench.gpu_ceilings import copy_bandwidth, device_memory_gb, fp8_gemm_rate, gemm_rate, gpu_machine_line
from bench.grpc_client import decode_round_trips_in_subprocess
from bench.model_shapes import SHAPES, decode_step_bytes, decode_weight_bytes, kv_bytes_per_token, prefill_flops, \
    random_checkpoint, random_tokens
from bench.peer_llama import build_peer, check_compiled_decode, peer_prefill, time_peer_decode
from bench.phases import Run, add_decode_options, log
from bench.prefill_cases import measure_chunked_prefill, measure_prefill, parse_chunked_prefill, \
    parse_prefill_cases
from bench.side_by_side import check_same_model, chunks_of, time_hf_generate
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.cache.blocks import blocks_for
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_options(parser, SHAPES, "llama3-8b", "1,8,32,64,128,256", steps=32, warmup=5)
    parser.add_argument("--prefill", default="1x4096,8x512", help="prefill cases NUMxLEN, comma-separated; "
                                                                  "'' for none")
    parser.add_argument("--chunked-prefill", default="", metavar="LENxCHUNK",
                        help="also one prompt of LEN tokens whole and in the worker's chunks of CHUNK, e.g. 32768x2048")
    parser.add_argument("--max-positions", type=int, default=None,
                        help="the shape's max_position_embeddings (e.g. 32768: Llama-3.1's context at 3-8B's widths)")
    parser.add_argument("--prefill-reps", type=int, default=5, help="timed prefills per case and implementation")
    parser.add_argument("--prefill-warmup", type=int, default=2, help="untimed prefills first")
    parser.add_argument("--copy-mb", type=int, default=4096, help="bytes copied to measure copy bandwidth (MB)")
    parser.add_argument("--gemm-size", type=int, default=8192, help="n of the n^3 bf16 GEMM for the GEMM rate")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="the engine's max_batch_tokens "
                                                                           "(raised to the largest prefill case)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="the engine's KV pool in blocks; default: what the largest phase needs, plus 8")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len; default: the longest sequence of the run")
    parser.add_argument("--engine-config", default="{}", help="more EngineConfig fields as JSON, e.g. "
                                                              "'{\"cuda_graph_batch_sizes\": [1, 8]}'")
    parser.add_argument("--peer-compile", default="reduce-overhead", choices=("reduce-overhead", "default", "none"),
                        help="how the peer's decode step is compiled")
    parser.add_argument("--skip-peer", action="store_true", help="measure the engine alone")
    parser.add_argument("--skip-engine", action="store_true",
                        help="measure the peer alone (where its KV cache and the engine's do not fit side by side)")
    parser.add_argument("--skip-grpc", action="store_true", help="no prefill or decode through gRPC")
    parser.add_argument("--hf-generate", action="store_true",
                        help="also time transformers' eager generate at batch 1 (small shapes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=480.0,
                        help="seconds after which no new phase starts (the table still prints)")
    parser.add_argument("--json", default=None, help="write every number here (default: $OUT/gpu_decode.json "
                                                     "where $OUT is set)")
    return parser.parse_args(argv)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape, device = SHAPES[args.shape], args.device
    if args.max_positions:
        shape = dataclasses.replace(shape, max_positions=args.max_positions)
    long_len, chunk = parse_chunked_prefill(args.chunked_prefill)
    batches = [int(b) for b in args.batches.split(",")]
    cases = parse_prefill_cases(args.prefill)
    max_batch = max(batches)
    decode_len = args.context + args.warmup + args.steps          # tokens a sequence holds after the last step
    check_tokens = random_tokens(2, min(64, args.context), shape.vocab, args.seed + 1)
    longest = max([decode_len, check_tokens.shape[1], long_len] + [length for _, length in cases])
    max_batch_tokens = max([args.max_batch_tokens, long_len] + [n * length for n, length in cases])
    if longest > shape.max_positions:
        raise SystemExit(f"sequences of {longest} tokens pass the shape's {shape.max_positions} positions")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.engine_config).items()}
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    if set(extra) - known:
        raise SystemExit(f"--engine-config: EngineConfig has no field(s) {sorted(set(extra) - known)}")
    # --quantize fp8: the floor reads the FP8 weights, prefill is held to the FP8 GEMM rate; the peer stays bf16.
    fp8 = extra.get("quantize") == "fp8"
    kv_itemsize = 1 if extra.get("kv_dtype") == "fp8" else 2     # --kv-dtype fp8: the floor reads e4m3 K and V
    run = Run(args.time_budget, device)
    result = {"args": vars(args), "shape": dataclasses.asdict(shape), "phases": run.phases, "errors": run.errors}

    print(gpu_machine_line("gpu_decode", device), flush=True)
    torch.manual_seed(args.seed)

    # Ceilings first, on an empty device.
    bandwidth, note = run.phase("copy bandwidth", copy_bandwidth, device, args.copy_mb * 10**6)
    gemm, _ = run.phase("GEMM rate", fp8_gemm_rate if fp8 else gemm_rate, device, args.gemm_size)
    gemm_name = "FP8 GEMM" if fp8 else "bf16 GEMM"
    if bandwidth is None or gemm is None:
        raise SystemExit(f"the ceilings could not be measured: {run.errors}")
    if device == "cuda":
        torch.cuda.empty_cache()
    result["copy_bandwidth_bytes_per_s"], result["gemm_flops_per_s"] = bandwidth, gemm
    weights, kv_token = decode_weight_bytes(shape, fp8), kv_bytes_per_token(shape, kv_itemsize)
    log(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write, median of 10 copies of {args.copy_mb} MB); "
        f"{gemm_name} {gemm / 1e12:.1f} TFLOP/s ({args.gemm_size}^3, median of 20)")
    log(f"{args.shape}: weights read per decode step {weights / 1e9:.3f} GB, KV {kv_token / 1e3:.1f} kB/token")

    checkpoint, _ = run.phase("random checkpoint", random_checkpoint, shape, args.seed, device)
    if checkpoint is None:
        raise SystemExit(f"no checkpoint: {run.errors}")
    if device == "cuda":
        torch.cuda.empty_cache()

    # The engine: a KV pool sized for the largest phase, max_model_len for the longest sequence.
    kv_blocks = args.kv_blocks or max([max_batch * blocks_for(decode_len, EngineConfig.kv_block_size)]
                                      + [n * blocks_for(length, EngineConfig.kv_block_size) for n, length in cases]
                                      + [blocks_for(long_len, EngineConfig.kv_block_size)]
                                      + [2 * blocks_for(check_tokens.shape[1], EngineConfig.kv_block_size)]) + 8
    max_model_len = args.max_model_len or longest
    if max_model_len < longest:
        raise SystemExit(f"--max-model-len {max_model_len} is under the {longest} tokens this run needs")
    # No prefix cache unless asked: each prefill rep computes the same tokens again, every one of them.
    config = EngineConfig(**{"device": device, "kv_blocks": kv_blocks, "max_batch_tokens": max_batch_tokens,
                             "max_seqs": max(512, max_batch), "max_model_len": max_model_len,
                             "prefix_cache": False, **extra})
    result["engine_config"] = dataclasses.asdict(config)
    built = None if args.skip_engine else run.phase("engine build", build_engine, checkpoint, config)[0]
    ours = EngineRunner(built[0], max_batch_tokens) if built else None
    if built:
        pool_gb = kv_blocks * config.kv_block_size * kv_token / 1e9
        log(f"engine: {config}; KV pool {kv_blocks} blocks ({pool_gb:.1f} GB); device {device_memory_gb(device)}")

    peer = None
    check_steps = 2
    # The check decodes check_steps tokens past its prompts: the peer's first caches must hold them too.
    peer_prefill_len = round_up(max([check_tokens.shape[1] + check_steps] + [length for _, length in cases]), 16)
    peer_prefill_batch = max([check_tokens.shape[0]] + [n for n, _ in cases])
    if not args.skip_peer:
        peer, note = run.phase("peer build", build_peer, checkpoint.config, checkpoint.tensors, peer_prefill_batch,
                               peer_prefill_len, device, torch.bfloat16, args.peer_compile)
        log(f"peer: compile {args.peer_compile}; device {device_memory_gb(device)}")
    hf_row = None
    if args.hf_generate:
        hf_row = DecodeRow(1, "hf-eager", 0.0)
        hf_ms, hf_row.note = run.phase("transformers generate", time_hf_generate, checkpoint, device,
                                       random_tokens(1, args.context, shape.vocab, args.seed + 3), args.steps)
        hf_row.step_ms = [hf_ms] if hf_ms else []
        if hf_ms:
            log(f"transformers eager generate, batch 1: {hf_ms:.2f} ms per token")
    del checkpoint
    gc.collect()

    # Same model on both sides: the logits of two prompts' prefill and of two decode steps after it.
    if ours and peer:
        checked, _ = run.phase("check: engine vs peer logits", check_same_model, ours, peer,
                               check_tokens.to(device), check_steps)
        result["check"] = checked
        if checked:
            warn = "" if checked["relative_error"] < 5e-2 and checked["finite"] else "  WARNING: not the same model?"
            log(f"check: {checked['prompts']} prompts of {check_tokens.shape[1]} tokens, then 2 decode steps, "
                f"engine vs peer (eager) logits: relative error per step "
                f"{', '.join(f'{e:.2e}' for e in checked['errors'])}, same argmax {checked['same_argmax']}"
                f"/{checked['compared']}, finite {checked['finite']}{warn}")

    worker = None
    if ours and not args.skip_grpc:
        # The engine behind a real WorkerServer on loopback; the client runs in a process of its own.
        server_config = WorkerConfig(host="127.0.0.1", port=0, reflection=False, drain_timeout=5.0, engine=config)
        worker, _ = run.phase("grpc worker", InProcessWorker,
                              lambda: WorkerServer(ours.engine, built[1], None, server_config))

    # Prefill: model FLOP/s against the GEMM rate.
    prefill_rows = measure_prefill(run, args, shape, cases, gemm, ours, peer, device, worker)
    chunked = measure_chunked_prefill(run, args, shape, long_len, chunk, ours, worker) if long_len and ours else {}
    result["chunked_prefill"] = {"tokens": long_len, "chunk": chunk, **chunked}

    # Decode at each batch size, the engine then the peer, side by side.
    decode_rows: list[DecodeRow] = []
    if peer:
        # One more position for the compiled-vs-eager check; rows of 16 for the efficient-attention bias.
        peer_decode_len = round_up(decode_len + 1, 16)
        _, note = run.phase("peer decode caches", peer.allocate_caches, max_batch, peer_decode_len)
        if note:
            peer = None
        log(f"peer caches {max_batch} x {peer_decode_len} tokens; device {device_memory_gb(device)}")
    mean_context = args.context + args.warmup + (args.steps + 1) / 2      # KV read per sequence, timed steps
    peer_failed = ""
    for batch in batches:
        floor_ms = decode_step_bytes(shape, batch, mean_context, fp8, kv_itemsize) / bandwidth * 1e3
        prompts = random_tokens(batch, args.context, shape.vocab, args.seed + 3)
        if ours:
            decode_rows.append(decode_engine_row(run, args, ours, batch, prompts, floor_ms))
        if worker:
            decode_rows.append(decode_grpc_row(run, args, worker, shape, batch, floor_ms))
            decode_rows.append(decode_grpc_row(run, args, worker, shape, batch, floor_ms, rpc="steps"))
            decode_rows.append(decode_grpc_row(run, args, worker, shape, batch, floor_ms, run_ahead=False))
        if peer and peer_failed:
            decode_rows.append(DecodeRow(batch, "peer", floor_ms, note=f"skipped: the peer failed at {peer_failed}"))
        elif peer:
            row = decode_peer_row(run, args, peer, batch, prompts, floor_ms, max_batch_tokens, device, result)
            if row.note.startswith("failed"):
                peer_failed = f"batch {batch}"
            decode_rows.append(row)
    if worker:
        worker.stop()
    if peer and device == "cuda":
        from torch._dynamo.utils import counters
        inductor = dict(counters["inductor"])
        result["peer_cudagraph_skips"] = inductor.get("cudagraph_skips", 0)
        result["peer_graphs_compiled"] = dict(counters["stats"]).get("unique_graphs", 0)
        result["peer_non_static_inputs_recorded"] = inductor.get("cudagraph_recorded_non_static_inputs", 0)
        log(f"peer: {result['peer_graphs_compiled']} graphs compiled (2 expected), cudagraph skips "
            f"{result['peer_cudagraph_skips']} (0 expected: every decode step a graph replay), non-static inputs "
            f"recorded {result['peer_non_static_inputs_recorded']} (2 per recorded graph expected, tokens and "
            f"position; 2 + 2 x layers would mean the KV caches are copied in at every replay)")

    if hf_row:
        hf_row.floor_ms = next((r.floor_ms for r in decode_rows if r.batch == 1), float("nan"))
        decode_rows.append(hf_row)
    result["decode"] = [row_record(r) for r in decode_rows]
    result["prefill"] = [row_record(r) for r in prefill_rows]
    result["elapsed_s"] = run.elapsed()
    result["peak_device_bytes_in_use"] = run.peak_bytes_in_use
    write_json(args.json, result)

    print(f"# decode: {args.context}-token contexts, {args.steps} timed steps after {args.warmup} warm-up; floor = "
          f"(weights {weights / 1e9:.2f} GB + KV of the timed steps' mean context) / copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s; metrale: device time (CUDA events from the end of the step's input upload "
          f"to the end of sampling), other = host clock around Engine.step; grpc: a client process's Decode round "
          f"trip with the engine running ahead (the next step runs while the answer travels), steps: the same over one "
          f"open Steps stream, grpc-sync: unary without run-ahead, idle ms: p50 of the time the device sat idle "
          f"between one step's sampling and the next step's forward (CUDA events), other = round trip - forward_us - "
          f"queue_us (transport, dispatch, conversion and the step's planning; negative where the run-ahead hid it); "
          f"peer: CUDA events around each graph replay, other = host wall per step; ratios of p50")
    print(format_decode_table(decode_rows))
    if prefill_rows:
        print(f"# prefill: model FLOPs (2 x params x tokens + causal attention, lm_head on last tokens) / p50 time, "
              f"against {gemm_name} {gemm / 1e12:.1f} TFLOP/s")
        print(format_prefill_table(prefill_rows))
    for where, key in (("engine", ""), ("through gRPC, a client process's Prefill round trip", "grpc ")):
        whole, in_chunks = chunked.get(f"{key}whole"), chunked.get(f"{key}chunked")
        if whole and in_chunks:
            whole_flops = prefill_flops(shape, 1, long_len) / (whole / 1e3)
            print(f"# one prompt of {long_len} tokens (time to first token, {where}): whole {whole:.1f} ms "
                  f"({whole_flops / 1e12:.1f} TFLOP/s, {whole_flops / gemm:.2f} of the GEMM rate), in the worker's "
                  f"chunks of {chunk} {in_chunks:.1f} ms ({in_chunks / whole:.3f}x)")
    print(f"# total {run.elapsed():.0f} s, device memory in use at most {run.peak_bytes_in_use / 1e9:.1f} GB "
          f"(at phase ends); phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in run.phases.items())
          + (f"; ERRORS: {run.errors}" if run.errors else ""))
    result["decode_rows"], result["prefill_rows"] = decode_rows, prefill_rows
    return result


def decode_engine_row(run: Run, args, ours, batch: int, prompts: torch.Tensor, floor_ms: float) -> DecodeRow:
    """The engine decoding `batch` prompts: device time per step, and the host clock around each step."""
    row = DecodeRow(batch, "metrale", floor_ms)
    if not ours:
        row.note = "no engine"
        return row

    def decode():
        try:
            first = ours.prefill(prompts)
            return ours.time_decode(first, args.warmup, args.steps)
        finally:
            ours.release_all()
    times, row.note = run.phase(f"decode batch {batch} metrale", decode)
    if times:
        row.step_ms, row.other_ms = times
        log(f"batch {batch} metrale: device p50 {row.p50_ms:.3f} ms ({row.times_floor:.2f}x floor {floor_ms:.3f}), "
            f"host clock around the step {row.other_p50_ms:.3f} ms")
    return row


def decode_grpc_row(run: Run, args, worker, shape, batch: int, floor_ms: float, run_ahead: bool = True,
                    rpc: str = "unary") -> DecodeRow:
    """The same decode through the worker's gRPC API, from a client in a process of its own, a unary Decode a
    step or (rpc="steps") a message a step on one Steps stream; run_ahead=False turns the engine's run-ahead off
    for the row (each step starts when its request arrives)."""
    row = DecodeRow(batch, "steps" if rpc == "steps" else "grpc" if run_ahead else "grpc-sync", floor_ms)
    engine, runs_ahead = worker.engine, worker.engine.runs_ahead
    engine.runs_ahead = run_ahead and runs_ahead
    timed = getattr(engine.runner, "take_rounds", None)     # the device's rounds on stream 0, the client's
    if timed:
        timed()
    try:
        times, row.note = run.phase(f"decode batch {batch} {row.impl}", decode_round_trips_in_subprocess,
                                    worker.address, batch, args.context, args.steps, args.warmup, shape.vocab,
                                    args.seed + 3, 300.0, rpc)
    finally:
        engine.runs_ahead = runs_ahead
    if times:
        row.step_ms = [t[0] for t in times]
        row.other_ms = [t[0] - t[1] - t[2] for t in times]
        if timed:       # the decode steps' rounds are the last ones (the prompts' came first)
            row.idle_ms = [idle for _, idle in timed()[-args.steps:]]
        log(f"batch {batch} {row.impl}: round trip p50 {row.p50_ms:.3f} ms ({row.times_floor:.2f}x floor); outside the "
            f"forward rounds (transport, dispatch, conversion, planning) p50 {row.other_p50_ms:.3f} ms, queue p50 "
            f"{sorted(t[2] for t in times)[len(times) // 2]:.3f} ms")
    return row


def decode_peer_row(run: Run, args, peer, batch: int, prompts: torch.Tensor, floor_ms: float,
                    max_batch_tokens: int, device: str, result: dict) -> DecodeRow:
    """The peer decoding the same prompts: CUDA events around each graph replay; its compiled step is checked
    against its eager forward (result["peer_compiled_vs_eager"])."""
    row = DecodeRow(batch, "peer", floor_ms)

    def decode():
        peer.use_rows(batch)
        first = torch.cat([peer_prefill(peer, chunk.to(device), offset) for offset, chunk in
                           chunks_of(prompts, max(1, max_batch_tokens // args.context))])
        times = time_peer_decode(peer, first, args.context, args.warmup, args.steps)
        return times, check_compiled_decode(peer, times.last_tokens, times.next_position)
    measured, row.note = run.phase(f"decode batch {batch} peer", decode)
    if measured:
        times, compiled_error = measured
        row.step_ms, row.other_ms = times.step_ms, [times.wall_ms_per_step]
        result.setdefault("peer_compiled_vs_eager", {})[batch] = compiled_error
        if not compiled_error < 5e-2:
            row.note = f"compiled step differs from eager: relative error {compiled_error:.2e}"
        log(f"batch {batch} peer: p50 {row.p50_ms:.3f} ms ({row.times_floor:.2f}x floor), wall "
            f"{times.wall_ms_per_step:.3f} ms/step; compiled vs eager logits {compiled_error:.2e}")
    return row


def write_json(path: str | None, result: dict) -> None:
    path = path or (os.path.join(os.environ["OUT"], "gpu_decode.json") if os.environ.get("OUT") else None)
    if not path:
        return
    serializable = {k: v for k, v in result.items() if k not in ("decode_rows", "prefill_rows")}
    with open(path, "w") as out:
        json.dump(serializable, out, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    from bench.grpc_overhead import quiet_logs
    quiet_logs()
    main()
    sys.stdout.flush()
