"""GPU decode and prefill of a random bf16 hybrid of Mamba2, attention and MLP layers (default: the Nemotron-H-8B
shape): the engine's device step and a gateway's Steps stream at each batch and context, against the floor (weights
+ attention KV + every sequence's SSM state read and written, over copy bandwidth) and transformers' eager generate
at batch 1; then one long prompt's prefill, with the device time of its scan and of its GEMMs (CUPTI).

Run from the repository root: python3 -m bench.gpu_ssm [--shape nemotron-h-8b] [--batches 1,32,128]
"""

import argparse
import dataclasses
import gc
import sys

import torch

from bench.decode_tables import DecodeRow, PrefillRow, format_decode_table, format_prefill_table, row_record
from bench.engine_runner import EngineRunner
from bench.gpu_ceilings import device_memory_gb, gpu_machine_line, measure_ceilings
from bench.gpu_decode import decode_engine_row, decode_grpc_row, write_json
from bench.kernel_parts import GEMM_KEYS, device_ms_by_part, format_parts
from bench.model_shapes import HYBRID_SHAPES, decode_step_bytes, hybrid_decode_weight_bytes, \
    hybrid_kv_bytes_per_token, hybrid_prefill_flops, hybrid_state_bytes, random_checkpoint, random_tokens
from bench.phases import Run, add_decode_options, add_run_options, log
from bench.side_by_side import time_hf_generate
from metrale.runtime.build import build_engine
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.config import EngineConfig
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer

# Kernel names -> the part of a prefill they do, first match wins (cuBLASLt's GEMMs go by several names).
KERNEL_PARTS = (("scan", ("ssm_scan", "ssm_chunk")), ("conv", ("ssm_conv",)), ("attention", ("attention",)),
                ("GEMMs", GEMM_KEYS))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_options(parser, HYBRID_SHAPES, "nemotron-h-8b", "1,32,128", steps=16, warmup=3, context=False)
    parser.add_argument("--contexts", default="1024,8192", help="tokens each sequence holds before decoding")
    parser.add_argument("--prefill", type=int, default=8192, help="tokens of the one prompt whose prefill is timed")
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--hf-steps", type=int, default=8, help="tokens transformers generates per timing; 0: none")
    parser.add_argument("--hf-compile", action="store_true",
                        help="also time transformers' generate with its forward under torch.compile")
    add_run_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape, device = HYBRID_SHAPES[args.shape], args.device
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(max(contexts) + args.warmup + args.steps + 1, args.prefill)
    run = Run(args.time_budget, device)
    result = {"args": vars(args), "shape": dataclasses.asdict(shape), "phases": run.phases, "errors": run.errors}
    print(gpu_machine_line("gpu_ssm", device), flush=True)

    bandwidth, gemm = measure_ceilings(run, device, args.copy_mb, args.gemm_size)
    weights, kv_token, state = (hybrid_decode_weight_bytes(shape), hybrid_kv_bytes_per_token(shape),
                                hybrid_state_bytes(shape))
    result.update(copy_bandwidth_bytes_per_s=bandwidth, gemm_flops_per_s=gemm, weight_bytes=weights,
                  kv_bytes_per_token=kv_token, state_bytes_per_seq=state)
    log(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, bf16 GEMM {gemm / 1e12:.1f} TFLOP/s; {args.shape}: weights "
        f"read per step {weights / 1e9:.2f} GB, attention KV {kv_token / 1e3:.1f} kB/token, SSM state "
        f"{state / 1e6:.1f} MB/sequence")
    checkpoint, _ = run.phase("random checkpoint", random_checkpoint, shape, args.seed, device)
    if checkpoint is None:
        raise SystemExit(f"no checkpoint: {run.errors}")
    if device == "cuda":
        torch.cuda.empty_cache()

    hf_rows: dict[int, list[DecodeRow]] = {}        # context -> transformers' rows at batch 1
    for context in contexts if args.hf_steps else ():
        prompt = random_tokens(1, context, shape.vocab, args.seed + 3)
        for impl, compiled in (("hf-eager", False), ("hf-compile", True))[:2 if args.hf_compile else 1]:
            row = DecodeRow(1, impl, 0.0)
            hf_ms, row.note = run.phase(f"transformers {impl} {context}", time_hf_generate, checkpoint, device,
                                        prompt, args.hf_steps, compiled)
            row.step_ms = [hf_ms] if hf_ms else []
            hf_rows.setdefault(context, []).append(row)
        if device == "cuda":
            torch.cuda.empty_cache()

    max_batch = max(batches)
    kv_blocks = max_batch * blocks_for(longest, EngineConfig.kv_block_size) + 8
    config = EngineConfig(device=device, kv_blocks=kv_blocks, max_batch_tokens=max(8192, args.prefill),
                          max_seqs=max_batch, max_model_len=longest, prefix_cache=False)
    result["engine_config"] = dataclasses.asdict(config)
    built, _ = run.phase("engine build", build_engine, checkpoint, config)
    del checkpoint
    gc.collect()
    if not built:
        raise SystemExit(f"no engine: {run.errors}")
    ours = EngineRunner(built[0], config.max_batch_tokens)
    log(f"engine: {config}; {built[0].cache.states.num_slots} state slots; device {device_memory_gb(device)}")
    worker = None
    if not args.skip_grpc:
        server_config = WorkerConfig(host="127.0.0.1", port=0, reflection=False, drain_timeout=5.0, engine=config)
        worker, _ = run.phase("grpc worker", InProcessWorker,
                              lambda: WorkerServer(ours.engine, built[1], None, server_config))

    tables = {}
    for context in contexts:
        rows = tables[context] = []
        mean_context = context + args.warmup + (args.steps + 1) / 2
        step_args = argparse.Namespace(context=context, steps=args.steps, warmup=args.warmup, seed=args.seed)
        for batch in batches:
            floor_ms = decode_step_bytes(shape, batch, mean_context) / bandwidth * 1e3
            prompts = random_tokens(batch, context, shape.vocab, args.seed + 3)
            rows.append(decode_engine_row(run, step_args, ours, batch, prompts, floor_ms))
            if worker:
                rows.append(decode_grpc_row(run, step_args, worker, shape, batch, floor_ms, rpc="steps"))
            for row in hf_rows.get(context, []) if batch == 1 else ():
                row.floor_ms = floor_ms
                rows.append(row)
    if worker:
        worker.stop()

    prefill_row = PrefillRow(1, args.prefill, "metrale", hybrid_prefill_flops(shape, 1, args.prefill), gemm)
    prompt = random_tokens(1, args.prefill, shape.vocab, args.seed + 2)
    times, prefill_row.note = run.phase("prefill", ours.time_prefill, prompt, 1, args.prefill_reps)
    prefill_row.step_ms = times or []
    parts, _ = run.phase("prefill kernels", device_ms_by_part, lambda: ours.time_prefill(prompt, 0, 1),
                         KERNEL_PARTS) if device == "cuda" else ({}, "")

    result["decode"] = {c: [row_record(r) for r in rows] for c, rows in tables.items()}
    result["prefill"] = row_record(prefill_row, kernel_parts_ms=parts)
    result["elapsed_s"] = run.elapsed()
    write_json(args.json, result)
    print(f"# decode: {args.steps} timed steps after {args.warmup} warm-up; floor = (weights {weights / 1e9:.2f} GB + "
          f"attention KV of the timed steps' mean context + SSM state {state / 1e6:.1f} MB a sequence read and "
          f"written) / copy bandwidth {bandwidth / 1e12:.3f} TB/s; metrale: device time (CUDA events), other = host "
          f"clock around Engine.step; steps: a client process's round trip over one Steps stream; hf-eager: "
          f"transformers' generate, bf16, ms per token (hf-compile: its forward under torch.compile)")
    for context, rows in tables.items():
        print(f"## {context}-token contexts")
        print(format_decode_table(rows))
    print(f"# prefill of one {args.prefill}-token prompt: model FLOPs (matrices, attention, scan) / p50 time, against "
          f"bf16 GEMM {gemm / 1e12:.1f} TFLOP/s")
    print(format_prefill_table([prefill_row]))
    if parts:
        print(format_parts("one prefill", parts))
    print(run.summary())
    result["decode_rows"], result["prefill_rows"] = tables, [prefill_row]
    return result


if __name__ == "__main__":
    from bench.grpc_overhead import quiet_logs
    quiet_logs()
    main()
    sys.stdout.flush()
