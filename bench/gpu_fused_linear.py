"""The fused linears (cuda_kernels/fused_linear.cu) against what they replace, on NLLB-200-600M's decoder linears:
device time per launch of the residual linear and the norm linear at every K split, next to cuBLASLt's linear
alone and cuBLASLt's linear plus norm.cu's layer_norm (the pair a fused launch stands for). Needs a CUDA GPU.

Each figure is a CUDA graph of back-to-back launches (bench/gpu_skinny_gemm.py's time_per_launch), cycling through
weight copies that span 3x the L2, as a decode step finds its weights. `floor` is the weight bytes at the copy
bandwidth measured in the same run.

Run from the repository root: python3 -m bench.gpu_fused_linear [--rows 4,64,256]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.gpu_skinny_gemm import L2_SPAN, WORKSPACE_BYTES, time_per_launch

# NLLB-200-600M's decoder linears: (name, N, K); each feeds a residual add or follows a norm.
SHAPES = (("out/cross", 1024, 1024, "residual"), ("fc2", 1024, 4096, "residual"), ("qkv", 3072, 1024, "norm"),
          ("cross_q", 1024, 1024, "norm"), ("fc1", 4096, 1024, "norm"))
LAUNCHES = 24


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,64,256")
    args = parser.parse_args(argv)

    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.kernels import fused_linear, norm
    from metrale.runtime.backend.cuda.tensor import DeviceTensor as T
    from metrale.runtime.default_model import default_cache_dir

    print(gpu_machine_line("gpu_fused_linear", "cuda"))
    copy = copy_bandwidth("cuda", 1 << 30)
    cuda = CudaDevice()
    lib = KernelLibrary(cuda.arch, KernelCache(default_cache_dir() / "kernels"))
    lt = CublasLt(T.from_torch(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")))
    stream = cuda.stream
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'linear':<10} {'N x K':>10} {'M':>4} {'floor us':>8} {'cuBLASLt':>8} {'+norm':>8} "
          + " ".join(f"{f'split {s}':>8}" for s in fused_linear.SPLITS) + "  planned")
    for name, n, k, kind in SHAPES:
        copies = -(-L2_SPAN * torch.cuda.get_device_properties(0).L2_cache_size // (n * k * 2))
        weights = [T.from_torch((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()) for _ in range(copies)]
        bias = T.from_torch(torch.randn(n, device="cuda").bfloat16())
        width = n if kind == "residual" else k      # the norm's: after the linear, or before it
        vectors = [T.from_torch(torch.randn(width, device="cuda").bfloat16()) for _ in range(2)]
        for m in (int(r) for r in args.rows.split(",")):
            x = T.from_torch(torch.randn(m, k, device="cuda").bfloat16())
            residual = T.from_torch(torch.randn(m, n, device="cuda").bfloat16())
            out = T.from_torch(torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
            normed, summed = (T.from_torch(torch.empty(m, width, device="cuda", dtype=torch.bfloat16)) for _ in "ab")
            stats = T.from_torch(torch.zeros(2 * m * max(n, k) // 64, device="cuda"))
            torch.cuda.synchronize()
            lt.linear(stream, out, x, weights[0], bias)       # plans the shape outside the capture
            stream.sync()

            def timed(launch):
                return time_per_launch(stream, [lambda w=weights[i % copies]: launch(w) for i in range(LAUNCHES)])

            cublas = timed(lambda w: lt.linear(stream, out, x, w, bias))
            if kind == "residual":
                paired = timed(lambda w: (lt.linear(stream, out, x, w, bias),
                                          norm.layer_norm(lib, stream, normed, out, *vectors, 1e-5, residual, summed)))
            else:
                paired = timed(lambda w: (norm.layer_norm(lib, stream, normed, x, *vectors, 1e-5),
                                          lt.linear(stream, out, normed, w, bias)))
            fused = []
            for splits in fused_linear.SPLITS:
                if not fused_linear.splits_take(k, splits):
                    fused.append(None)
                elif kind == "residual":
                    fused.append(timed(lambda w, s=splits: fused_linear.linear_residual(
                        lib, stream, out, x, w, bias, residual, stats, s)))
                else:
                    fused.append(timed(lambda w, s=splits: fused_linear.linear_norm(
                        lib, stream, out, x, stats, *vectors, 1e-5, w, bias, False, s)))
            planned = fused_linear.plan_splits(m, n, k, sms)
            cells = " ".join(f"{t * 1e6:8.2f}" if t is not None else f"{'-':>8}" for t in fused)
            print(f"{name:<10} {f'{n}x{k}':>10} {m:>4} {n * k * 2 / copy * 1e6:8.2f} {cublas * 1e6:8.2f} "
                  f"{paired * 1e6:8.2f} {cells}  {planned}", flush=True)
        del weights


if __name__ == "__main__":
    main()
