"""A decode linear of our own that takes part in PDL, against cuBLASLt's, each in the chain a beam step runs it in:
(layer_norm_partials, linear) pairs back to back, the linear writing split-K partials that the next norm sums (as
`Ops.linear_layer_norm` does at 64 rows: 4 K slices at K = 1024, 8 at 4096). The question (bench/NOTES.md, session
15): cuBLASLt's kernels do not take part in PDL, so every one of a step's 72 linears starts ~0.5 µs after the
kernel before it ends and the kernel after it ~0.7 µs after it ends; ours copies its weight tile into shared
memory before its griddepcontrol.wait, while the norm before it runs, and lets the next norm launch early.

Ours is the persistent prototype's split-K phase (bench/persistent_kernels.py: mma.sync m16n8k16 on swizzled
shared tiles, a CTA a (n tile, K slice), 128 CTAs) as one launch. µs a pair, CUDA graphs of back-to-back pairs
timed with events, the linears' weights cycling through copies spanning 3x the L2; and each linear's partials
against torch. Run from the repository root: python3 -m bench.gpu_pdl_linear
"""

import argparse
from pathlib import Path

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line, time_per_pair
from bench.persistent_kernels import CTAS, PHASE_DTYPE, PHASE_PARTS, ROWS, THREADS, TILE_BYTES, Split

L2_SPAN = 3
PAIRS = 24
# The linears a step hands a norm as partials, split as linear_layer_norm splits them at 64 rows.
SPLITS = (Split("o / cross q / cross o 1024 x 1024", 1024, 1024, 32, 256),
          Split("fc2 1024 x 4096", 1024, 4096, 64, 512))

SOURCE = PHASE_PARTS + r"""
#include "common.cuh"

// One linear's split-K partials as a launch of its own (CTAS CTAs): the CTA's weight tile goes into shared memory
// before the wait for the kernel ahead (a weight is no kernel's output), x's slice after it, then the tile's mma
// and its partial. Dynamic shared memory: the weight tile, then x's slice (phase.n_tile x k_slice and ROWS x
// k_slice bf16).
extern "C" __global__ void __launch_bounds__(THREADS, 1) pdl_linear(const Phase* phase, const bf16* x,
                                                                   long long x_stride, long long copy) {
    extern __shared__ __align__(128) unsigned char shared[];
    const Phase p = *phase;                       // written once by the host
    bf16* ws = reinterpret_cast<bf16*>(shared);
    bf16* xs = reinterpret_cast<bf16*>(shared + p.n_tile * p.k_slice * 2);
    load_weight_tile(ws, p, copy);
    copy_async_commit();
    wait_for_previous_kernel();
    load_tile(xs, x + tile_k_block(p) * p.k_slice, x_stride, ROWS, p.k_slice);
    copy_async_commit();
    copy_async_wait<0>();
    __syncthreads();
    multiply_tile(p, xs, ws);
}
"""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    from cuda.bindings import driver
    from cuda.core import Device, ObjectCode

    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary, compile_cubin, with_headers
    from metrale.runtime.backend.cuda.device import CudaDevice, check
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch
    from metrale.runtime.backend.cuda.kernels.norm import layer_norm_partials
    from metrale.runtime.backend.cuda.launch import launch_kernel
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    cuda = CudaDevice()
    lib = KernelLibrary(cuda.arch, KernelCache(Path("/tmp/metrale-bench-kernels")))   # turns PDL on for sm_90
    kernel = ObjectCode.from_cubin(compile_cubin("pdl_linear", with_headers(SOURCE), cuda.arch)).get_kernel(
        "pdl_linear")
    check(driver.cuKernelSetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      2 * TILE_BYTES, kernel.handle, Device().device_id))
    stream = cuda.stream
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    view = DeviceTensor.from_torch
    print(gpu_machine_line("gpu_pdl_linear", "cuda"))
    print(f"# {ROWS} rows, {CTAS} CTAs x {THREADS} threads, {kernel.attributes.num_regs} registers; µs a launch "
          f"alone, and a (norm, linear) pair")
    print(f"{'linear':<34} {'splits':>6} {'cuBLASLt':>8} {'ours':>6} {'cuBLASLt pair':>13} {'ours pair':>9} "
          f"{'gain':>6} {'rel err':>8}")
    results = []
    for split in SPLITS:
        split.check()
        n, k, splits = split.n, split.k, split.k // split.k_slice
        copies = -(-L2_SPAN * l2 // (n * k * 2))
        weights = (torch.randn(copies, n, k, device="cuda") * k ** -0.5).bfloat16()
        partials = torch.zeros(splits * ROWS, n, device="cuda")
        record = np.zeros(1, dtype=PHASE_DTYPE)
        record[0] = (weights.data_ptr(), n * k, copies, partials.data_ptr(), n, k, split.n_tile, split.k_slice)
        phase = torch.from_numpy(record.view(np.uint8)).cuda()
        x = (torch.randn(ROWS, k, device="cuda") * 0.5).bfloat16()
        norm = [view(t) for t in ((1 + 0.1 * torch.randn(n, device="cuda")).bfloat16(),
                                  (0.1 * torch.randn(n, device="cuda")).bfloat16())]
        h, residual = (view(torch.zeros(ROWS, n, dtype=torch.bfloat16, device="cuda")) for _ in range(2))
        # At K = n the norm's output is the next linear's input, as in a step; fc2's input stays x.
        x_view = h if k == n else view(x)
        shared = (split.n_tile + ROWS) * split.k_slice * 2

        def ours(i: int, x_in=x_view) -> None:
            launch_kernel(stream, kernel, CTAS, THREADS, np.uint64(phase.data_ptr()), x_in, np.int64(x_in.stride),
                          np.int64(i % copies), shmem=shared)

        def theirs(i: int, x_in=x_view) -> None:
            lt.linear(stream, view(partials), x_in, view(weights[i % copies]), splits=splits)

        def normed() -> None:
            layer_norm_partials(lib, stream, h, view(partials), splits, None, *norm, 1e-5, residual, residual)

        ours(0, view(x))                                             # correctness, on x
        torch.cuda.synchronize()
        stream.sync()
        expected = x.float() @ weights[0].float().T
        error = float((partials.view(splits, ROWS, n).sum(0) - expected).abs().max() / expected.abs().max())
        theirs(0)                                                    # cuBLASLt plans the shape outside the capture
        stream.sync()
        row = {"linear": split.name, "splits": splits, "relative_error": error}
        for name, linear in (("cublaslt", theirs), ("ours", ours)):
            row[f"{name}_us"] = time_per_launch(stream, [lambda i=i: linear(i) for i in range(PAIRS)]) * 1e6
            row[f"{name}_pair_us"] = time_per_pair(stream, lambda i, f=linear: (normed, lambda: f(i)), PAIRS) * 1e6
        results.append(row)
        print(format_row(row), flush=True)
    lt.close()
    return results


def format_row(row: dict) -> str:
    gain = row["cublaslt_pair_us"] - row["ours_pair_us"]
    return (f"{row['linear']:<34} {row['splits']:6d} {row['cublaslt_us']:8.2f} {row['ours_us']:6.2f} "
            f"{row['cublaslt_pair_us']:13.2f} {row['ours_pair_us']:9.2f} {gain:6.2f} {row['relative_error']:8.1e}")


if __name__ == "__main__":
    main()
