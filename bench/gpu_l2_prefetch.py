"""Whether a decode step's cuBLASLt linears gain from their weights being prefetched into L2 by the kernel before
them: each linear of NLLB-200-600M's decoder at 64 rows (16 requests x 4 beams) after a stand-in for the norm or
attention kernel that precedes it in a step (launched with PDL, ~2.5 µs), with and without that kernel issuing
`cp.async.bulk.prefetch.L2` of the linear's weight before its griddepcontrol.wait. Beside them: the linear alone
with its weight cold (cycling copies that span 3x the L2, as a step finds them) and warm (one copy, L2-resident).
The LM head (525 MB, bandwidth-bound where the others are latency-bound) gets at most --prefetch-mb of its weight
prefetched: does its first wave of tiles gain from finding its rows in L2?

µs a (kernel, linear) pair, CUDA graphs of back-to-back pairs timed with events (gemm_tuning.time_per_launch).
Run from the repository root: python3 -m bench.gpu_l2_prefetch [--rows 64] [--spin-ns 2500]
"""

import argparse

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line, time_per_pair

SHAPES = (("qkv", 3072, 1024), ("o / cross q / cross o", 1024, 1024), ("fc1", 4096, 1024), ("fc2", 1024, 4096),
          ("lm head", 256256, 1024))
L2_SPAN = 3
PAIRS = 24

SOURCE = r"""
#include "common.cuh"

// A stand-in for the kernel ahead of a linear: with bytes > 0 it first asks the TMA unit to bring
// weight[0, bytes) into L2 (each block a 16-byte-aligned share, in pieces of at most 1 MiB), before waiting on the
// kernel ahead of it (the weights are no kernel's output); then it spins spin_ns on the global timer.
extern "C" __global__ void stand_in(const char* weight, long long bytes, long long spin_ns) {
    if (threadIdx.x == 0 && bytes > 0) {
        const long long share = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~15ll;
        const long long begin = share * blockIdx.x;
        for (long long at = begin; at < begin + share && at < bytes; at += 1ll << 20) {
            const long long end = min(min(at + (1ll << 20), begin + share), bytes);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(weight + at), "r"((unsigned int)(end - at))
                         : "memory");
        }
    }
    wait_for_previous_kernel();
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < spin_ns);
}
"""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--spin-ns", type=int, default=2500)
    parser.add_argument("--blocks", type=int, default=64, help="the stand-in's blocks (a norm's: one per row)")
    parser.add_argument("--prefetch-mb", type=int, default=32, help="the most of a weight the stand-in prefetches")
    args = parser.parse_args(argv)
    from cuda.core import ObjectCode

    from metrale.runtime.backend.cuda.compiler import compile_cubin, with_headers
    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch
    from metrale.runtime.backend.cuda.launch import launch_kernel, use_programmatic_launch
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    cuda = CudaDevice()
    use_programmatic_launch(cuda.arch == "sm_90a")
    kernel = ObjectCode.from_cubin(compile_cubin("stand_in", with_headers(SOURCE), cuda.arch)).get_kernel("stand_in")
    stream = cuda.stream
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(gpu_machine_line("gpu_l2_prefetch", "cuda"))
    print(f"# {args.rows} rows; the stand-in: {args.blocks} blocks spinning {args.spin_ns} ns; µs a launch or pair")
    print(f"{'linear':<22} {'N x K':>10} {'alone cold':>10} {'alone warm':>10} {'pair':>8} {'prefetched':>10} "
          f"{'gain':>6}")
    results = []
    for name, n, k in SHAPES:
        weight_bytes = n * k * 2
        prefetched = min(weight_bytes, args.prefetch_mb << 20)
        copies = max(2, -(-L2_SPAN * l2 // weight_bytes))
        weights = [DeviceTensor.from_torch((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16())
                   for _ in range(copies)]
        x = DeviceTensor.from_torch(torch.randn(args.rows, k, device="cuda").bfloat16())
        out = DeviceTensor.from_torch(torch.empty(args.rows, n, dtype=torch.bfloat16, device="cuda"))
        lt.linear(stream, out, x, weights[0])
        stream.sync()
        linear = lambda w: lt.linear(stream, out, x, w)
        stand_in = lambda w, prefetch: launch_kernel(stream, kernel, args.blocks, 128, np.uint64(w.ptr),
                                                     np.int64(prefetched if prefetch else 0), np.int64(args.spin_ns))
        pick = lambda i: weights[i % copies]
        row = {"linear": name, "n": n, "k": k, "rows": args.rows,
               "cold_us": time_per_launch(stream, [lambda w=pick(i): linear(w) for i in range(PAIRS)]) * 1e6,
               "warm_us": time_per_launch(stream, [lambda: linear(weights[0]) for _ in range(PAIRS)]) * 1e6}
        for key, prefetch in (("pair_us", False), ("prefetched_us", True)):
            row[key] = time_per_pair(stream, lambda i, p=prefetch: (lambda: stand_in(pick(i), p),
                                                                    lambda: linear(pick(i))), PAIRS) * 1e6
        print(f"{name:<22} {f'{n}x{k}':>10} {row['cold_us']:10.2f} {row['warm_us']:10.2f} {row['pair_us']:8.2f} "
              f"{row['prefetched_us']:10.2f} {row['pair_us'] - row['prefetched_us']:6.2f}", flush=True)
        results.append(row)
    lt.close()
    return results


if __name__ == "__main__":
    main()
