"""GPU decode and prefill of a random bf16 mixture of experts (default: the Qwen3-30B-A3B shape, 48 layers of 128
experts, top-8; deepseek-v2-lite: multi-head latent attention with 64 experts, top-6; hy4-12l: Hy4's sparse latent
attention, 256 experts and hyper-connections, 12 of its layers): transformers' generate at
batch 1 on the model it initialised, then the engine from the same weights (loaded from safetensors shards written
to --checkpoint-dir, where given: load time and the host's peak memory reported), its device step and a gateway's
Steps stream at each batch against the floor (the dense weights, the experts the step's tokens routed to, counted in
the run, and the KV or latent cache, over copy bandwidth), the prefill of 8 prompts of 1k tokens against the GEMM
rate, one long prompt whole and in the worker's chunks, and the kernels' shares of a decode step and of the prefill
(CUPTI).

Run from the repository root: python3 -m bench.gpu_moe [--shape qwen3-30b-a3b] [--batches 1,8,64,256]
"""

import argparse
import dataclasses
import gc
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from bench.decode_tables import DecodeRow, PrefillRow, format_decode_table, format_prefill_table, row_record
from bench.engine_runner import EngineRunner
from bench.gpu_ceilings import device_memory_gb, gpu_machine_line, measure_ceilings
from bench.gpu_decode import decode_grpc_row, write_json
from bench.kernel_parts import GEMM_KEYS, device_ms_by_part, format_parts
from bench.model_shapes import random_tokens
from bench.moe_shapes import MOE_SHAPES, MoeShape, decode_step_bytes, expert_bytes, hf_config, kv_bytes_per_token, \
    mha_kv_bytes_per_token, prefill_flops, require_fp8_floor, total_params
from bench.phases import Run, add_decode_options, add_run_options, log
from bench.side_by_side import time_generate
from metrale.runtime.build import build_engine
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import Checkpoint, load_checkpoint
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer

KERNEL_PARTS = (("routing", ("moe_route",)), ("grouped GEMMs", ("moe_grouped_gemm", "moe_skinny_gemm")),
                ("combine", ("moe_combine",)), ("indexer", ("index_",)), ("hyper-connections", ("hyper_",)),
                ("attention", ("attention", "latent")), ("GEMMs", GEMM_KEYS), ("norms", ("norm",)),
                ("rope + KV", ("rope", "write_kv")), ("activation", ("silu", "binary")))
SHARD_BYTES = 5 << 30
COUNTED_STEPS = 4           # decode steps whose routing is read back to count the experts hit


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_options(parser, MOE_SHAPES, "qwen3-30b-a3b", "1,8,64,256", steps=16, warmup=3)
    parser.add_argument("--prefill", default="8x1024", help="prompts x tokens of the timed prefill ('' none)")
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--chunked-prefill", default="8192x1024",
                        help="TOKENSxCHUNK: one prompt of TOKENS prefilled whole, then in the worker's chunks of "
                             "CHUNK ('' none)")
    parser.add_argument("--hf-steps", type=int, default=8, help="tokens transformers generates per timing; 0: none")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="write the weights here as safetensors shards and load the engine from them")
    parser.add_argument("--quantize", default="none", choices=("none", "fp8"),
                        help="the engine's --quantize (fp8: the floor counts e4m3 weights with a scale a row)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.quantize == "fp8":
        try:
            require_fp8_floor(MOE_SHAPES[args.shape])
        except ValueError as error:
            parser.error(f"--quantize fp8 --shape {args.shape}: {error}")
    return args


class RoutingProbe:
    """Which experts each MoE layer's latest forward routed to, for the floor: on CUDA a copy of moe_route's
    offsets after each route, into a buffer per layer (captured into the decode graphs with the route; installed
    before the engine is built); on the CPU the chosen ids. Layers are told apart by call order."""

    def __init__(self, device: str, shape: MoeShape):
        self.device, self.shape, self.calls = device, shape, 0
        self.offsets = torch.zeros(shape.moe_layers, shape.experts + 1, dtype=torch.int32, device=device)
        self.hit = [0] * shape.moe_layers

    def install(self) -> None:
        """Wraps the launcher (CUDA) or the router (CPU) until uninstall()."""
        if self.device == "cuda":
            from cuda.bindings import driver

            from metrale.runtime.backend.cuda.kernels import moe
            route = moe.route

            def probed(lib, stream, routed, *args):
                route(lib, stream, routed, *args)
                row = self.offsets[self._next_layer()]
                driver.cuMemcpyDtoDAsync(row.data_ptr(), routed.offsets.ptr, row.nbytes, int(stream.handle))
            self._wrapped = (moe, "route", route)
        else:
            from metrale.runtime.backend.cpu import moe
            route = moe.route

            def probed(x, router):
                weights, ids = route(x, router)
                self.hit[self._next_layer()] = int(ids.unique().numel())
                return weights, ids
            self._wrapped = (moe, "route", route)
        setattr(self._wrapped[0], self._wrapped[1], probed)

    def uninstall(self) -> None:
        setattr(*self._wrapped)

    def _next_layer(self) -> int:
        layer = self.calls % self.shape.moe_layers
        self.calls += 1
        return layer

    def experts_hit(self) -> int:
        """Experts the latest forward ran, summed over the layers."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            counts = self.offsets[:, 1:] - self.offsets[:, :-1]
            return int((counts > 0).sum())
        return sum(self.hit)


def random_hf_model(shape: MoeShape, device: str, seed: int):
    """transformers' Qwen3MoeForCausalLM of the shape on the device, bf16, its own random initialisation, the
    routers' weights N(0, 0.02) (a router left at zeros would send every token to the same experts)."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**hf_config(shape))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.normal_(0.0, 0.02)
    return model


def host_checkpoint(model, shape: MoeShape) -> Checkpoint:
    """The model's weights on the host under transformers' names (its experts stacked, as our loader takes them)."""
    tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    return Checkpoint(config=hf_config(shape), tensors=tensors, source="random bf16 qwen3-moe")


def write_shards(checkpoint: Checkpoint, directory: Path) -> None:
    """The checkpoint as safetensors shards of about SHARD_BYTES with an index, as released checkpoints are."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, tensor in checkpoint.tensors.items():
        if current and size + tensor.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += tensor.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file))
        weight_map.update({name: file for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(checkpoint.config))


class ResidentPeak:
    """The process's largest resident memory while the block runs, sampled every 50 ms, in two parts: anonymous
    (memory the process allocated: a host copy of the weights would show here) and file-backed (checkpoint pages
    mapped while they are read: page cache the kernel reclaims under pressure). ru_maxrss would keep the lifetime's
    peak, which the host copy of the weights before the build already set."""

    def __enter__(self):
        self.anon_gb, self.file_gb = resident_gb()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.05):
            self._update()

    def _update(self):
        anon, file = resident_gb()
        self.anon_gb, self.file_gb = max(self.anon_gb, anon), max(self.file_gb, file)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self._update()


def resident_gb() -> tuple[float, float]:
    """(anonymous, file-backed) resident GB of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields.get(name, "0 kB").split()[0]) / 1e6 for name in ("RssAnon", "RssFile"))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape, device = MOE_SHAPES[args.shape], args.device
    batches = [int(b) for b in args.batches.split(",")]
    prompts, prompt_len = (int(v) for v in args.prefill.split("x")) if args.prefill else (0, 0)
    long_len, chunk = (int(v) for v in args.chunked_prefill.split("x")) if args.chunked_prefill else (0, 0)
    longest = max(args.context + args.warmup + args.steps + COUNTED_STEPS + 1, prompt_len, long_len)
    run = Run(args.time_budget, device)
    result = {"args": vars(args), "shape": dataclasses.asdict(shape), "phases": run.phases, "errors": run.errors}
    print(gpu_machine_line("gpu_moe", device), flush=True)

    bandwidth, gemm = measure_ceilings(run, device, args.copy_mb, args.gemm_size)
    result.update(copy_bandwidth_bytes_per_s=bandwidth, gemm_flops_per_s=gemm, params=total_params(shape),
                  expert_bytes=expert_bytes(shape))
    log(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, bf16 GEMM {gemm / 1e12:.1f} TFLOP/s; {args.shape}: "
        f"{total_params(shape) / 1e9:.2f} B parameters, an expert {expert_bytes(shape) / 1e6:.2f} MB")

    model, _ = run.phase("transformers model", random_hf_model, shape, device, args.seed)
    if model is None:
        raise SystemExit(f"no model: {run.errors}")
    hf_row = None
    if args.hf_steps:
        hf_row = DecodeRow(1, "hf-eager", 0.0)
        prompt = random_tokens(1, args.context, shape.vocab, args.seed + 3)
        hf_ms, hf_row.note = run.phase("transformers generate", time_generate, model, device, prompt, args.hf_steps)
        hf_row.step_ms = [hf_ms] if hf_ms else []
        result["hf_experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    checkpoint, _ = run.phase("weights to the host", host_checkpoint, model, shape)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    load_note = "from host memory"
    if args.checkpoint_dir and checkpoint is not None:
        directory = Path(args.checkpoint_dir)
        need = sum(t.nbytes for t in checkpoint.tensors.values())
        free = shutil.disk_usage(directory.parent if not directory.exists() else directory).free
        if free > 1.1 * need:
            run.phase("write shards", write_shards, checkpoint, directory)
            checkpoint = load_checkpoint(directory)
            gc.collect()
            load_note = f"from {len(list(directory.glob('*.safetensors')))} safetensors shards"
        else:
            load_note = f"from host memory: {free / 1e9:.0f} GB free on disk, {need / 1e9:.0f} GB needed"
    if checkpoint is None:
        raise SystemExit(f"no checkpoint: {run.errors}")

    probe = RoutingProbe(device, shape)
    probe.install()
    max_batch = max(batches)
    kv_blocks = max(max_batch * blocks_for(longest, EngineConfig.kv_block_size),
                    prompts * blocks_for(prompt_len, EngineConfig.kv_block_size)) + 8
    config = EngineConfig(device=device, kv_blocks=kv_blocks,
                          max_batch_tokens=max(8192, prompts * prompt_len, long_len),
                          max_seqs=max(max_batch, prompts), max_model_len=longest, prefix_cache=False,
                          cuda_graph_batch_sizes=tuple(sorted(set(batches))), quantize=args.quantize)
    result["engine_config"] = dataclasses.asdict(config)
    host_before = resident_gb()
    started = time.perf_counter()
    with ResidentPeak() as resident:
        built, _ = run.phase("engine build", build_engine, checkpoint, config)
    load_s = time.perf_counter() - started
    del checkpoint
    gc.collect()
    if not built:
        raise SystemExit(f"no engine: {run.errors}")
    result["load"] = {"seconds": load_s, "note": load_note, "anon_gb_before": host_before[0],
                      "anon_gb_peak": resident.anon_gb, "file_gb_peak": resident.file_gb}
    ours = EngineRunner(built[0], config.max_batch_tokens)
    log(f"engine: built in {load_s:.1f} s ({load_note}); host resident {host_before[0]:.1f} GB anonymous before, "
        f"{resident.anon_gb:.1f} GB at most during the build (file-backed {resident.file_gb:.1f} GB); device "
        f"{device_memory_gb(device)}")
    worker = None
    if not args.skip_grpc:
        server_config = WorkerConfig(host="127.0.0.1", port=0, reflection=False, drain_timeout=5.0, engine=config)
        worker, _ = run.phase("grpc worker", InProcessWorker,
                              lambda: WorkerServer(ours.engine, built[1], None, server_config))

    rows, hits, step_parts = [], {}, {}
    mean_context = args.context + args.warmup + (args.steps + 1) / 2
    fp8 = args.quantize == "fp8"
    step_args = argparse.Namespace(context=args.context, steps=args.steps, warmup=args.warmup, seed=args.seed)
    for batch in batches:
        row = DecodeRow(batch, "metrale", 0.0)
        tokens = random_tokens(batch, args.context, shape.vocab, args.seed + 3)
        measured, row.note = run.phase(f"decode batch {batch} metrale", decode_and_count, ours, probe, tokens,
                                       args.warmup, args.steps, device == "cuda")
        if measured:
            (row.step_ms, row.other_ms), hits[batch], step_parts[batch] = measured
        row.floor_ms = decode_step_bytes(shape, batch, mean_context, hits.get(batch, 0), fp8) / bandwidth * 1e3
        rows.append(row)
        if worker:
            rows.append(decode_grpc_row(run, step_args, worker, shape, batch, row.floor_ms, rpc="steps"))
        if batch == 1 and hf_row:
            hf_row.floor_ms = row.floor_ms
            rows.append(hf_row)
    if worker:
        worker.stop()
    probe.uninstall()

    prefill_row, prefill_parts = None, {}
    if prompts:
        prefill_row = PrefillRow(prompts, prompt_len, "metrale", prefill_flops(shape, prompts, prompt_len), gemm)
        tokens = random_tokens(prompts, prompt_len, shape.vocab, args.seed + 2)
        times, prefill_row.note = run.phase("prefill", ours.time_prefill, tokens, 1, args.prefill_reps)
        prefill_row.step_ms = times or []
        if device == "cuda":
            prefill_parts, _ = run.phase("prefill kernels", device_ms_by_part, lambda: ours.time_prefill(tokens, 0, 1),
                                         KERNEL_PARTS)

    chunked = {}
    if long_len:
        tokens = random_tokens(1, long_len, shape.vocab, args.seed + 4)
        for name, size in (("whole", 0), ("chunked", chunk)):
            times, _ = run.phase(f"prefill {long_len} {name}", ours.time_prefill, tokens, 1, args.prefill_reps, size)
            chunked[name] = sorted(times)[len(times) // 2] if times else None
    result["chunked_prefill"] = {"tokens": long_len, "chunk": chunk, **chunked}

    result["decode"] = [row_record(r) for r in rows]
    result["experts_hit"] = hits
    result["decode_kernel_parts_ms"] = step_parts
    if prefill_row:
        result["prefill"] = row_record(prefill_row, kernel_parts_ms=prefill_parts)
    result["elapsed_s"] = run.elapsed()
    write_json(args.json, result)
    print(f"# load: engine built in {load_s:.1f} s {load_note}; the process's anonymous resident memory "
          f"{host_before[0]:.1f} GB before the build, {resident.anon_gb:.1f} GB at most during it, the checkpoint's "
          f"mapped pages {resident.file_gb:.1f} GB at most ({total_params(shape) * 2 / 1e9:.1f} GB of weights)")
    print(f"# decode at {args.context}-token contexts: {args.steps} timed steps after {args.warmup} warm-up; floor = "
          f"(dense weights + the experts the step's tokens routed to, counted over {COUNTED_STEPS} steps: "
          + ", ".join(f"batch {b} {hits[b] / shape.layers:.1f} of {shape.experts} a layer" for b in hits)
          + f", {expert_bytes(shape, fp8) / 1e6:.2f} MB each{' in FP8' if fp8 else ''} + KV) / copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s; "
          f"metrale: device time (CUDA events); steps: a client process's round trip over one Steps stream; "
          f"hf-eager: transformers' generate, bf16, ms per token")
    print(format_decode_table(rows))
    for batch, parts in step_parts.items():
        if parts:
            print(format_parts(f"a decode step at batch {batch}", parts))
    if prefill_row:
        print(f"# prefill of {prompts} x {prompt_len} tokens: model FLOPs (attention, router, top-{shape.top_k} "
              f"experts) / p50 time, against bf16 GEMM {gemm / 1e12:.1f} TFLOP/s")
        print(format_prefill_table([prefill_row]))
        if prefill_parts:
            print(format_parts("one prefill", prefill_parts))
    if chunked.get("whole") and chunked.get("chunked"):
        print(f"# one prompt of {long_len} tokens: whole {chunked['whole']:.1f} ms, in the worker's chunks of {chunk} "
              f"{chunked['chunked']:.1f} ms ({chunked['chunked'] / chunked['whole']:.3f}x)")
    if shape.kv_lora:
        print(f"# the latent cache: {kv_bytes_per_token(shape)} bytes a token over the {shape.layers} layers, where "
              f"every head's K and V would take {mha_kv_bytes_per_token(shape)} "
              f"({mha_kv_bytes_per_token(shape) / kv_bytes_per_token(shape):.1f}x)")
    print(run.summary())
    result["decode_rows"], result["prefill_rows"] = rows, [prefill_row] if prefill_row else []
    return result


def decode_and_count(ours: EngineRunner, probe: RoutingProbe, tokens: torch.Tensor, warmup: int, steps: int,
                     profile: bool) -> tuple[tuple[list[float], list[float]], float, dict]:
    """The batch prefilled, `steps` timed decode steps, then COUNTED_STEPS more whose routing is read back (the
    mean experts hit a step, summed over the layers), and one under the profiler (CUDA) for the kernels' shares."""
    try:
        next_tokens = ours.prefill(tokens)
        times = ours.time_decode(next_tokens, warmup, steps)
        hit = 0
        for _ in range(COUNTED_STEPS):
            ours.time_decode(next_tokens, 1, 0)
            hit += probe.experts_hit()
        parts = device_ms_by_part(lambda: ours.time_decode(next_tokens, 1, 0), KERNEL_PARTS) if profile else {}
        return times, hit / COUNTED_STEPS, parts
    finally:
        ours.release_all()


if __name__ == "__main__":
    from bench.grpc_overhead import quiet_logs
    quiet_logs()
    main()
    sys.stdout.flush()
