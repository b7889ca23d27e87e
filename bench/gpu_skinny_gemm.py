"""The skinny GEMM (cuda_kernels/gemv.cu) against our cuBLASLt linear on the decode linears of Llama-3-8B,
SmolLM2-135M and NLLB-200-600M at M = 1, 8, 16 (cuBLASLt alone above the skinny kernel's 16 rows): device time
per launch, weight bytes / time, and that as a fraction of the copy bandwidth measured in the same run (read +
write bytes, DESIGN.md §6). Needs a CUDA GPU.

Each case is a CUDA graph of back-to-back launches timed with events on the launching stream, so the figure is
device time, launch gaps inside a graph included, Python excluded. The launches cycle through copies of the weight
that together span 3x the L2, as a decode step finds its weights: not in L2. Both implementations run the same
launches; `rel diff` is the skinny kernel's relative difference from cuBLASLt on the last case.

Run from the repository root:
    python3 -m bench.gpu_skinny_gemm [--tokens 1,8,16,64] [--models nllb-600m] [--launches 20]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line

# (model, linear, N, K, out dtype); logits are bf16, as the LM head writes them.
SHAPES = (
    ("llama3-8b", "qkv", 6144, 4096, "bfloat16"), ("llama3-8b", "o", 4096, 4096, "bfloat16"),
    ("llama3-8b", "gate_up", 28672, 4096, "bfloat16"), ("llama3-8b", "down", 4096, 14336, "bfloat16"),
    ("llama3-8b", "lm_head", 128256, 4096, "bfloat16"),
    ("smollm2-135m", "qkv", 960, 576, "bfloat16"), ("smollm2-135m", "o", 576, 576, "bfloat16"),
    ("smollm2-135m", "gate_up", 3072, 576, "bfloat16"), ("smollm2-135m", "down", 576, 1536, "bfloat16"),
    ("smollm2-135m", "lm_head", 49152, 576, "bfloat16"),
    ("nllb-600m", "qkv", 3072, 1024, "bfloat16"), ("nllb-600m", "o", 1024, 1024, "bfloat16"),
    ("nllb-600m", "fc1", 4096, 1024, "bfloat16"), ("nllb-600m", "fc2", 1024, 4096, "bfloat16"),
)
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
L2_SPAN = 3                  # the weight copies of a case span this many L2 caches
REPEATS = 5                  # graph replays timed per case; the median counts
WORKSPACE_BYTES = 32 << 20   # cuBLASLt workspace, as the tests give it


def time_per_launch(stream, launches: list) -> float:
    """Seconds per launch: launches captured as one CUDA graph, replayed REPEATS times; median (gemm_tuning.py)."""
    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch as timed
    return timed(stream, launches, REPEATS)


def run_case(lib, lt, stream, n: int, k: int, out_dtype: str, tokens: list[int], min_launches: int) -> list[dict]:
    """One linear shape at each M: timings of both implementations and their relative difference."""
    from metrale.runtime.backend.cuda.kernels.skinny_gemm import MAX_M, skinny_linear
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    weight_bytes = n * k * 2
    copies = -(-L2_SPAN * torch.cuda.get_device_properties(0).L2_cache_size // weight_bytes)
    weights = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    weight_views = [DeviceTensor.from_torch(w) for w in weights]
    launches = max(min_launches, copies)
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        out_skinny = torch.full((m, n), float("nan"), dtype=TORCH_DTYPES[out_dtype], device="cuda")
        out_lt = torch.full_like(out_skinny, float("nan"))
        x_view, skinny_view, lt_view = (DeviceTensor.from_torch(t) for t in (x, out_skinny, out_lt))
        skinny = m <= MAX_M
        torch.cuda.synchronize()
        # One eager call each first: cuBLASLt plans the shape outside the capture; the outputs are compared.
        if skinny:
            skinny_linear(lib, stream, skinny_view, x_view, weight_views[0])
        if lt is not None:
            lt.linear(stream, lt_view, x_view, weight_views[0])
        stream.sync()
        row = {"n": n, "k": k, "m": m, "weight_bytes": weight_bytes}
        if skinny:
            row["skinny_s"] = time_per_launch(stream, [
                lambda w=weight_views[i % copies]: skinny_linear(lib, stream, skinny_view, x_view, w)
                for i in range(launches)])
        if lt is not None:
            row["cublaslt_s"] = time_per_launch(stream, [
                lambda w=weight_views[i % copies]: lt.linear(stream, lt_view, x_view, w) for i in range(launches)])
        if lt is not None and skinny:
            difference = (out_skinny.double() - out_lt.double()).norm() / out_lt.double().norm()
            row["rel_diff"] = float(difference)
        rows.append(row)
    del weights
    return rows


def format_row(model: str, linear: str, out_dtype: str, row: dict, copy: float) -> str:
    def columns(seconds: float | None) -> str:
        if seconds is None:
            return f"{'n/a':>8} {'':>7} {'':>6}"
        rate = row["weight_bytes"] / seconds
        return f"{seconds * 1e6:8.2f} {rate / 1e9:7.0f} {rate / copy:6.3f}"

    shape = f"{row['n']}x{row['k']}" + (" f32" if out_dtype == "float32" else "")
    skinny, lt = row.get("skinny_s"), row.get("cublaslt_s")
    speedup = f"{lt / skinny:7.2f}" if lt is not None and skinny is not None else f"{'':>7}"
    diff = f"{row['rel_diff']:9.1e}" if "rel_diff" in row else ""
    return f"{model + ' ' + linear:<22} {shape:>15} {row['m']:>3} {columns(skinny)} {columns(lt)} {speedup} {diff}"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,16", help="M values, comma-separated (the skinny kernel's at most 16)")
    parser.add_argument("--models", default="llama3-8b,smollm2-135m,nllb-600m", help="models whose linears run")
    parser.add_argument("--launches", type=int, default=20, help="launches per graph (more if the weight copies are)")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the copy-bandwidth measurement")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]

    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    from metrale.runtime.default_model import default_cache_dir
    from metrale.runtime.errors import FailedPrecondition

    print(gpu_machine_line("gpu_skinny_gemm", "cuda"))
    copy = copy_bandwidth("cuda", args.copy_mb << 20)
    print(f"# copy bandwidth {copy / 1e9:.0f} GB/s (read + write); GB/s below = weight bytes / device time")
    cuda = CudaDevice()
    lib = KernelLibrary(cuda.arch, KernelCache(default_cache_dir() / "kernels"))
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    try:
        lt = CublasLt(DeviceTensor.from_torch(workspace))
    except FailedPrecondition as error:
        print(f"# cuBLASLt unavailable, skinny kernel only: {error}")
        lt = None
    print(f"{'linear':<22} {'N x K':>15} {'M':>3} {'skinny':>8} {'GB/s':>7} {'/copy':>6} {'cuBLASLt':>8} {'GB/s':>7} "
          f"{'/copy':>6} {'speedup':>7} {'rel diff':>9}")
    results = []
    for model, linear, n, k, out_dtype in (shape for shape in SHAPES if shape[0] in args.models.split(",")):
        for row in run_case(lib, lt, cuda.stream, n, k, out_dtype, tokens, args.launches):
            print(format_row(model, linear, out_dtype, row, copy), flush=True)
            results.append({"model": model, "linear": linear, "out_dtype": out_dtype, **row})
    if lt is not None:
        lt.close()
    print("# times in us per launch; /copy = weight GB/s over copy bandwidth; speedup = cuBLASLt time / skinny time")
    return results


if __name__ == "__main__":
    main()
