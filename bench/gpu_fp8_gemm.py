"""FP8 weights' linears against bf16's on the decode and prefill linears of Llama-3-8B: the skinny GEMM at M = 1, 8,
16 (FP8: the weight widened to bf16 in registers) as weight bytes / device time over the copy bandwidth of the same
run; cuBLASLt at more rows, bf16 against FP8 (the input quantized per token, then the W8A8 matmul; and the matmul
alone) in TFLOP/s. With --blocks, the FP8 weights are in 128 x 128 blocks as DeepSeek's and Qwen3's releases are (a
scale a row per 128 columns on the device) and the input is quantized per token and 128 columns. Needs a CUDA GPU
with FP8 (sm_89 and later).

Each case is a CUDA graph of back-to-back launches timed with events (gpu_skinny_gemm.py's method), over weight
copies that together span 3x the L2.

Run from the repository root:
    python3 -m bench.gpu_fp8_gemm [--skinny 1,8,16] [--rows 64,256,1024,8192] [--blocks]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.gpu_skinny_gemm import L2_SPAN, WORKSPACE_BYTES, time_per_launch

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def weights(n: int, k: int, copies: int, blocks: bool):
    """copies of a random [N, K] weight: (bf16 DeviceTensor, Fp8Matrix) each, and the torch tensors behind them; the
    FP8 weight quantized a row, or in 128 x 128 blocks (blocks)."""
    from metrale.runtime.backend.cuda.fp8_matrix import BLOCK, Fp8Matrix, device_scales
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    from metrale.runtime.loading.fp8 import E4M3_MAX, Fp8Weight, quantize_rows

    weight = torch.randn(n, k) / k ** 0.5
    if blocks:
        grid = weight.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        scale = grid.abs().amax(dim=(1, 3)) / E4M3_MAX
        data = (grid / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
        fp8 = Fp8Weight.of_checkpoint(data, scale, (BLOCK, BLOCK))
    else:
        fp8 = quantize_rows(weight)
    data, scales, bf16 = fp8.data.cuda(), device_scales(fp8).cuda(), fp8.dequantize().bfloat16().cuda()
    held = [(bf16.clone(), data.clone(), scales.clone()) for _ in range(copies)]
    views = [(DeviceTensor.from_torch(b), Fp8Matrix(DeviceTensor.from_torch(d), DeviceTensor.from_torch(s), blocks))
             for b, d, s in held]
    return views, held


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skinny", default="1,8,16", help="M values of the skinny GEMM, comma-separated")
    parser.add_argument("--rows", default="64,256,1024,8192", help="M values of cuBLASLt, comma-separated")
    parser.add_argument("--launches", type=int, default=20, help="launches per graph (more if the weight copies are)")
    parser.add_argument("--blocks", action="store_true", help="FP8 weights in 128 x 128 blocks, inputs by 128 columns")
    args = parser.parse_args(argv)

    from metrale.runtime.backend.cuda import kernels
    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    from metrale.runtime.default_model import default_cache_dir

    print(gpu_machine_line("gpu_fp8_gemm", "cuda"))
    copy = copy_bandwidth("cuda", 1024 << 20)
    print(f"# copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    cuda = CudaDevice()
    stream = cuda.stream
    lib = KernelLibrary(cuda.arch, KernelCache(default_cache_dir() / "kernels"))
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    print(f"{'linear':<8} {'N x K':>11} {'M':>5} {'bf16 us':>8} {'/copy':>6} {'fp8 us':>8} {'/copy':>6} {'speedup':>7}"
          f" {'fp8 gemm us':>11} {'bf16 TF/s':>9} {'fp8 TF/s':>8}")
    for linear, n, k in SHAPES:
        copies = -(-L2_SPAN * l2 // (n * k))
        views, held = weights(n, k, copies, args.blocks)
        launches = max(args.launches, copies)
        for m in [int(t) for t in args.skinny.split(",")] + [int(t) for t in args.rows.split(",")]:
            x = DeviceTensor.from_torch(torch.randn(m, k, device="cuda").bfloat16())
            out = DeviceTensor.from_torch(torch.empty(m, n, device="cuda").bfloat16())
            q = DeviceTensor.from_torch(torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda"))
            q_scales = DeviceTensor.from_torch(torch.empty((k // 128, m) if args.blocks else (m,), device="cuda"))
            quantize = kernels.fp8.quantize_groups if args.blocks else kernels.fp8.quantize_rows
            torch.cuda.synchronize()
            if m <= kernels.skinny_gemm.MAX_M:
                def bf16(w): kernels.skinny_gemm.skinny_linear(lib, stream, out, x, w[0])
                def fp8(w): kernels.skinny_gemm.skinny_linear(lib, stream, out, x, w[1])
                gemm_only = None
            else:
                def bf16(w): lt.linear(stream, out, x, w[0])
                def gemm_only(w): lt.fp8_linear(stream, out, q, q_scales, w[1])
                def fp8(w):
                    quantize(lib, stream, q, q_scales, x)
                    gemm_only(w)
            for run in (bf16, fp8) + ((gemm_only,) if gemm_only else ()):
                run(views[0])            # cuBLASLt plans the shape outside the capture
            stream.sync()
            times = {name: time_per_launch(stream, [lambda w=views[i % copies], run=run: run(w)
                                                    for i in range(launches)])
                     for name, run in (("bf16", bf16), ("fp8", fp8), ("gemm", gemm_only)) if run is not None}
            flops = 2 * m * n * k
            row = {"linear": linear, "n": n, "k": k, "m": m, **{f"{name}_s": t for name, t in times.items()}}
            results.append(row)
            gemm = f"{times['gemm'] * 1e6:11.2f}" if "gemm" in times else f"{'':>11}"
            fp8_bytes = n * k + 4 * held[0][2].numel()           # the e4m3 values and their scales
            print(f"{linear:<8} {f'{n}x{k}':>11} {m:>5} {times['bf16'] * 1e6:8.2f} "
                  f"{2 * n * k / times['bf16'] / copy:6.3f} {times['fp8'] * 1e6:8.2f} "
                  f"{fp8_bytes / times['fp8'] / copy:6.3f} {times['bf16'] / times['fp8']:7.2f} {gemm} "
                  f"{flops / times['bf16'] / 1e12:9.0f} {flops / times['fp8'] / 1e12:8.0f}", flush=True)
        del held
    lt.close()
    print("# /copy: weight bytes / time over copy bandwidth (bf16: 2 N K; fp8: N K + its scales' 4 N, or 4 N K / 128 "
          "in blocks); fp8 us includes the "
          "input's quantization past 16 rows ('fp8 gemm us': the matmul alone); speedup = bf16 time / fp8 time")
    return results


if __name__ == "__main__":
    main()
