"""The attention kernels alone on the GPU: paged decode attention as a fraction of copy bandwidth (the KV it
must read / time), and prefill attention against torch's scaled_dot_product_attention (flash) measured in the
same run, in causal TFLOP/s. Llama-3-8B heads: 32 query heads, 8 KV heads, head_dim 128, KV blocks of 16.

Run from the repository root: python3 -m bench.gpu_attention [--sweep] [--prefill-only | --decode-only]
[--kv-dtype fp8]
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.kernel_variant import add_variant_option, variant_libraries

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16     # BLOCK: the worker's default kv_block_size
DECODE_CASES = ((1, 1024), (1, 4096), (1, 8192), (8, 4096), (32, 1024), (64, 1024), (64, 2000), (64, 4096),
                (256, 1024), (8, 32768), (16, 8192), (64, 8192), (1, 32768), (16, 32768), (64, 32768))
PREFILL_CASES = ((1, 4096), (1, 16384), (1, 32768), (8, 4096), (8, 16384), (8, 32768))
SWEEP = (64, 128, 256, 512, 1024, 2048)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time decode at each partition size in SWEEP")
    parser.add_argument("--reps", type=int, default=20, help="launches per timed CUDA graph")
    parser.add_argument("--prefill-only", action="store_true", help="time prefill attention only")
    parser.add_argument("--decode-only", action="store_true", help="time decode attention only")
    parser.add_argument("--block-size", type=int, default=BLOCK, help="tokens a KV block (the worker's default: 16)")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"),
                        help="fp8: decode over an FP8 cache (e4m3, a scale a KV head: its largest value over 448)")
    add_variant_option(parser, "prefill_attention_hopper.cu")
    return parser.parse_args(argv)


def paged_kv(batch: int, context: int, block_size: int, device: str = "cuda"):
    """A random KV cache of batch sequences of `context` tokens each, blocks shuffled; (kv, tables)."""
    per_seq = math.ceil(context / block_size)
    num_blocks = batch * per_seq
    kv = torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, per_seq).contiguous()
    return kv, tables


def fp8_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [2, blocks, block_size, kv_heads, head_dim] bf16 as an FP8 cache holds it: (e4m3 values, scales [2,
    kv_heads] float32, each head's largest magnitude over 448), quantized a slice of blocks at a time."""
    from metrale.runtime.loading.fp8 import E4M3_MAX, to_e4m3
    scales = (kv.abs().amax(dim=(1, 2, 4)).float() / E4M3_MAX).contiguous()
    values = torch.empty(kv.shape, dtype=torch.float8_e4m3fn, device=kv.device)
    step = 4096
    for start in range(0, kv.shape[1], step):
        values[:, start:start + step] = to_e4m3(kv[:, start:start + step].float() / scales.view(2, 1, 1, -1, 1))
    return values, scales


def time_graph(stream, launch, reps: int, replays: int = 5) -> float:
    """Seconds per launch(): `reps` calls captured into one CUDA graph on `stream`, replayed back to back."""
    builder = stream.create_graph_builder()
    builder.begin_building("thread_local")
    for _ in range(reps):
        launch()
    builder.end_building()
    graph = builder.complete()
    graph.upload(stream)
    return seconds_per_replay(graph, stream, replays) / reps


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)


def seconds_per_replay(graph, stream, replays: int, warmup: int = 1) -> float:
    """A captured graph's device time: replays launched back to back after warmup ones, host clock between syncs."""
    for _ in range(warmup):
        graph.launch(stream)
    stream.sync()
    started = time.perf_counter()
    for _ in range(replays):
        graph.launch(stream)
    stream.sync()
    return (time.perf_counter() - started) / replays


def decode_case(lib, stream, batch: int, context: int, block_size: int, reps: int, partition=None,
                fp8: bool = False) -> float:
    from metrale.runtime.backend.cuda.kernels.attention import decode_workspace_elements, paged_decode_attention
    from metrale.runtime.backend.cuda.tensor import DeviceTensor as D, Fp8KvTensor
    kv, tables = paged_kv(batch, context, block_size)
    scales = None
    if fp8:      # the cache the kernel reads, and the values it holds for the reference
        kv, scales = fp8_kv(kv)
    q = torch.randn(batch, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    contexts = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    elements = decode_workspace_elements(lib, batch, HEADS, KV_HEADS, HEAD_DIM, context, partition)
    workspace = torch.empty(max(elements, 4), device="cuda", dtype=torch.float32)
    # Launches cycle through copies of the KV that together cover 3x the L2, so each reads from HBM, as in a
    # model step (where the layer's weights pass through the L2 in between).
    copies = [kv] + [kv.clone() for _ in range(math.ceil(3 * l2_bytes() / kv.nbytes) - 1)]
    torch.cuda.synchronize()
    args = [D.from_torch(t) for t in (out, q, kv, rows, contexts, tables, workspace)]
    caches = [D.from_torch(c) if scales is None else
              Fp8KvTensor(c.data_ptr(), tuple(c.shape), "float8_e4m3", scales=D.from_torch(scales)) for c in copies]
    launched = []

    def launch():
        cache = caches[len(launched) % len(caches)]
        launched.append(cache)
        paged_decode_attention(lib, stream, args[0], args[1], cache, *args[3:6], args[6] if elements else None,
                               HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, -1, context, partition)
    seconds = time_graph(stream, launch, max(reps, len(caches)))
    del copies
    if scales is not None:
        kv = kv.float() * scales.view(2, 1, 1, -1, 1)
    reference = F.scaled_dot_product_attention(
        q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).float(),
        kv[0][tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).float(),
        kv[1][tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).float(),
        scale=HEAD_DIM ** -0.5) if batch * context <= 64 * 4096 else None
    if reference is not None:
        error = ((out.float().view_as(reference) - reference).norm() / reference.norm()).item()
        assert error < 1e-2, f"decode {batch}x{context}: relative error {error:.2e}"
    return seconds


def prefill_case(lib, stream, batch: int, length: int, block_size: int, reps: int, variants: dict) -> tuple:
    """({kernel: (s, relative error against SDPA)} for ours, "cp.async" (ours gathering every tile), "mma.sync" and
    each variant; SDPA s) for `batch` causal sequences of `length` tokens each."""
    from metrale.runtime.backend.cuda.kernels.attention import paged_prefill_attention
    from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
    from metrale.runtime.backend.cuda.tensor_maps import paged_kv_map
    kv, tables = paged_kv(batch, length, block_size)
    q = torch.randn(batch * length, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    starts = torch.arange(batch, device="cuda", dtype=torch.int32) * length
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    # SDPA on the same K/V, gathered to [B, heads, T, hd] (as the peer holds them), GQA without repeats.
    keys = kv[0][tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()
    values = kv[1][tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()
    queries = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
    reference = sdpa().float()
    for _ in range(3):
        sdpa()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        sdpa()
    torch.cuda.synchronize()
    theirs = (time.perf_counter() - started) / reps

    args = [D.from_torch(t) for t in (out, q, kv, starts, lens, lens, tables)]
    paged_kv_map(args[2])    # made and uploaded before the launches are captured

    def timed(hopper, library=lib, tma=True) -> tuple[float, float]:
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        seconds = time_graph(stream, lambda: paged_prefill_attention(
            library, stream, *args, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, -1, batch, length, hopper=hopper,
            tma=tma), max(2, reps // 4))
        got = out.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).float()
        return seconds, ((got - reference).norm() / reference.norm()).item()
    kernels = {"ours": timed(None), "cp.async": timed(None, tma=False), "mma.sync": timed(False)}
    kernels.update({name: timed(None, variant) for name, variant in variants.items()})
    return kernels, theirs


def kernel_library():
    """(KernelLibrary, cuda.core stream) on device 0, kernels cached where the worker caches them."""
    from cuda.core import Device

    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import arch_of
    from metrale.runtime.default_model import default_cache_dir
    device = Device(0)
    device.set_current()
    return KernelLibrary(arch_of(device), KernelCache(default_cache_dir() / "kernels")), device.create_stream()


def main(argv=None) -> None:
    args = parse_args(argv)
    print(gpu_machine_line("gpu_attention", "cuda"), flush=True)
    bandwidth = copy_bandwidth("cuda", 2 * 10**9)
    lib, stream = kernel_library()
    if not args.prefill_only:
        decode_table(lib, stream, args, bandwidth)
    if args.decode_only:
        return
    print(f"# prefill attention, causal sequences, KV blocks of {args.block_size}; "
          "TFLOP/s = 2 * 2 * T^2 / 2 * heads * head_dim * batch / time; "
          "cp.async: ours gathering every K/V tile instead of loading whole ones through the tensor map; "
          "mma.sync: prefill_attention.cu, the kernel other architectures run; !: an output off SDPA's by more than "
          "1e-2 relative (a wrong kernel, or a variant timing a part)")
    variants = variant_libraries(lib, "prefill_attention_hopper", args.variant)
    variants.pop("package")
    print(f"{'batch':>5} {'tokens':>7} {'ours ms':>8} {'ours TF/s':>9} {'cp.async TF/s':>13} {'mma.sync TF/s':>13} "
          f"{'sdpa ms':>8} {'sdpa TF/s':>9} {'ours/sdpa':>9} {'rel err':>8}"
          + "".join(f" {name + ' TF/s':>14}" for name in variants))
    for batch, length in PREFILL_CASES:
        kernels, theirs = prefill_case(lib, stream, batch, length, args.block_size, args.reps, variants)
        flops = 2 * length * length * HEADS * HEAD_DIM * batch

        def rate(name: str, width: int) -> str:   # TFLOP/s, marked "!" past bf16's error
            seconds, error = kernels[name]
            return f"{f'{flops / seconds / 1e12:.1f}' + ('' if error < 1e-2 else '!'):>{width}}"
        ours, error = kernels["ours"]
        print(f"{batch:5d} {length:7d} {ours * 1e3:8.3f} {rate('ours', 9)} {rate('cp.async', 13)} "
              f"{rate('mma.sync', 13)} {theirs * 1e3:8.3f} {flops / theirs / 1e12:9.1f} {theirs / ours:9.2f} "
              f"{error:8.1e}" + "".join(f" {rate(name, 14)}" for name in variants), flush=True)


def decode_table(lib, stream, args, bandwidth: float) -> None:
    fp8 = args.kv_dtype == "fp8"
    kv_token = 2 * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
    print(f"# paged decode attention, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
          f"blocks of {args.block_size}{', an FP8 cache (a byte a value)' if fp8 else ''}; fraction of copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (KV bytes / time, attention and merge launches)")
    partitions = (None,) + (SWEEP if args.sweep else ())
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{'default' if p is None else p:>14}" for p in partitions))
    for batch, context in DECODE_CASES:
        cells = []
        for partition in partitions:
            seconds = decode_case(lib, stream, batch, context, args.block_size, args.reps, partition, fp8)
            fraction = batch * context * kv_token / seconds / bandwidth
            cells.append(f"{seconds * 1e6:7.1f}us {fraction:4.2f}")
        print(f"{batch:5d} {context:7d} " + " ".join(f"{c:>14}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
