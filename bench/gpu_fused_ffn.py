"""A decoder layer's whole FFN (fc1, ReLU, fc2) as one kernel of 128 CTAs, against cuBLASLt's two launches, alone
and in the chain a beam step runs it in (norm, FFN, next norm). The question (bench/NOTES.md, session 17): at 64
rows each cuBLASLt linear costs ~2.9 µs of fixed latency plus its weight's stream at ~3 TB/s (fc1 5.9, fc2 5.5 µs
for 8 MB each); one kernel that streams both weights at once from its first instruction would pay the fixed part
once and keep more bytes in flight: ~5 µs where the pair takes ~11.4 plus the gap between them.

The split: a cluster of FFN_Q = 8 CTAs owns a partition of 256 of the FFN's 4096 columns (16 partitions). CTA q of
the cluster multiplies x by 32 rows of fc1's weight (64 KB, in shared memory from the kernel's start) and shares
its 64 x 32 slice of h = relu(x W1^T + b1), in bf16 as cuBLASLt's fc1 writes it, with the cluster's 8 CTAs through
distributed shared memory; then multiplies the partition's h (64 x 256) by fc2's weight tile for its 128 output
columns (128 x 256, 64 KB, loaded at the start too, by the other half of the CTA's threads, so that fc1's
product need not wait for it) into the partition's fp32 partial. The next norm sums the 16 partials
(`layer_norm_partials` built with room for 16, where the package's reads at most 8). Rows past 64 loop over the
weights already in shared memory.

µs per FFN, CUDA graphs of back-to-back chains timed with events, the weights cycling through copies spanning 3x
the L2, and the partials' sum against torch at 64, 17 and 256 rows. Run from the repository root:
python3 -m bench.gpu_fused_ffn
"""

import argparse
from pathlib import Path

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line, time_per_pair
from bench.persistent_kernels import PHASE_PARTS

L2_SPAN = 3
CHAINS = 24
D_MODEL, FFN = 1024, 4096             # NLLB-200-600M's decoder
FFN_Q, FFN_HC, FFN_KC = 8, 32, 128    # the cluster's CTAs, h columns a CTA computes, x's K chunk
PART = FFN_Q * FFN_HC                 # h columns a cluster shares
ROWS = 64


def shared_bytes(d: int) -> int:
    """The kernel's dynamic shared memory: fc1's rows, fc2's tile, two x chunks, the partition's h (bf16)."""
    return 2 * (FFN_HC * d + (d // FFN_Q) * PART + 2 * ROWS * FFN_KC + ROWS * PART)


SOURCE = PHASE_PARTS + rf"""
#include "common.cuh"

#define FFN_Q {FFN_Q}
#define FFN_HC {FFN_HC}
#define FFN_KC {FFN_KC}
#define FFN_PART {PART}
#define LOADERS (THREADS / 2)          // the threads that copy fc1's rows and x, and the others fc2's tile

namespace {{

// rows x (cols / 8) 16-byte chunks of a row-major bf16 matrix into shared memory, swizzled, by the LOADERS threads
// from `first`; rows from `valid` on are zero.
__device__ __forceinline__ void load_rows(bf16* shared, const bf16* global, long long stride, int rows, int valid,
                                          int cols, int first) {{
    const int chunks = cols / 8;
    for (int i = threadIdx.x - first; i < rows * chunks; i += LOADERS) {{
        const int row = i / chunks, chunk = i % chunks;
        const bool inside = row < valid;
        copy_async_16(shared + 8 * swizzled(row, chunk, chunks), global + (inside ? row * stride + 8 * chunk : 0),
                      inside);
    }}
}}

// Every CTA of the cluster arrives, then waits for the others: writes before it (distributed shared memory
// included) are visible after it.
__device__ __forceinline__ void cluster_barrier() {{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}}

// 32 bits into the same place of CTA `rank`'s shared memory as `local` in this CTA's.
__device__ __forceinline__ void store_to_rank(const void* local, unsigned rank, unsigned value) {{
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(value) : "memory");
}}

// This CTA's 64 x FFN_HC slice of h = relu(acc + b1), as bf16 pairs, into columns q * FFN_HC of every cluster
// CTA's h (64 x FFN_PART, swizzled as multiply<> reads it). acc is multiply<1>'s layout: warp w's rows
// (w & 1) * 32 + 16 m + g (+ 8), columns (w >> 1) * 8 + 2 t (+ 1).
__device__ __forceinline__ void share_h(bf16* hs, const float (&acc)[2][8][4], const bf16* b1, int q) {{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int col = (warp >> 1) * 8 + 2 * t, chunk = q * (FFN_HC / 8) + (warp >> 1);
    const float bias0 = bf16_to_float(b1[col]), bias1 = bf16_to_float(b1[col + 1]);
#pragma unroll
    for (int m = 0; m < 2; ++m) {{
#pragma unroll
        for (int half = 0; half < 2; ++half) {{
            const int row = (warp & 1) * 32 + 16 * m + g + 8 * half;
            const unsigned pair = float2_to_bf16x2(fmaxf(acc[m][0][2 * half] + bias0, 0.f),
                                                   fmaxf(acc[m][0][2 * half + 1] + bias1, 0.f));
            const bf16* at = hs + 8 * swizzled(row, chunk, FFN_PART / 8) + 2 * t;
#pragma unroll
            for (unsigned rank = 0; rank < FFN_Q; ++rank) store_to_rank(at, rank, pair);
        }}
    }}
}}

// The partition's partial for rows [row0, row0 + valid): out [m, d] fp32, this CTA's columns from n0.
template <int NT>
__device__ __forceinline__ void fc2_tile(float* out, int d, int n0, int row0, int valid, const bf16* hs,
                                         const bf16* ws2) {{
    float acc[2][8][4] = {{}};
    multiply<NT>(hs, ws2, FFN_PART, acc);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* base = out + (long long)row0 * d + n0 + (warp >> 1) * NT * 8 + 2 * t;
#pragma unroll
    for (int m = 0; m < 2; ++m) {{
#pragma unroll
        for (int half = 0; half < 2; ++half) {{
            const int row = (warp & 1) * 32 + 16 * m + g + 8 * half;
            if (row >= valid) continue;
#pragma unroll
            for (int j = 0; j < NT; ++j)
                *reinterpret_cast<float2*>(base + (long long)row * d + 8 * j) =
                    make_float2(acc[m][j][2 * half], acc[m][j][2 * half + 1]);
        }}
    }}
}}

}}  // namespace

// partials [f / FFN_PART, m, d] fp32 = the FFN's output by partitions of its columns, from x [m, d] bf16 (row
// stride x_stride), w1 [f, d], b1 [f], w2 [d, f] bf16. Grid (FFN_Q, f / FFN_PART) in clusters of FFN_Q along x,
// THREADS threads, shared_bytes(d) of dynamic shared memory; d a multiple of FFN_KC with d / FFN_Q a multiple of 32
// up to 256. Both weights' tiles are copied in before the wait for the kernel before (no kernel writes them).
extern "C" __global__ void __cluster_dims__(FFN_Q, 1, 1) __launch_bounds__(THREADS, 1) fused_ffn(
        float* partials, const bf16* x, long long x_stride, int m, const bf16* w1, const bf16* b1, const bf16* w2,
        int d, int f) {{
    extern __shared__ __align__(128) unsigned char shared[];
    const int q = blockIdx.x, p = blockIdx.y, h0 = p * FFN_PART + q * FFN_HC, no = d / FFN_Q, n0 = q * no;
    const int chunks = d / FFN_KC;
    bf16* ws1 = reinterpret_cast<bf16*>(shared);               // chunks blocks of FFN_HC x FFN_KC
    bf16* ws2 = ws1 + FFN_HC * d;                              // no x FFN_PART
    bf16* xs = ws2 + no * FFN_PART;                            // two ROWS x FFN_KC chunks
    bf16* hs = xs + 2 * ROWS * FFN_KC;                         // ROWS x FFN_PART
    // Warps 0-3 copy fc1's rows, then x; warps 4-7 fc2's tile. cp.async groups complete in a thread's own order,
    // so fc1's product waits for fc1's rows and x only, while fc2's tile is still on its way.
    const bool fc1_loader = threadIdx.x < LOADERS;
    if (fc1_loader) {{
        for (int c = 0; c < chunks; ++c)
            load_rows(ws1 + c * FFN_HC * FFN_KC, w1 + (long long)h0 * d + c * FFN_KC, d, FFN_HC, FFN_HC, FFN_KC, 0);
    }} else {{
        load_rows(ws2, w2 + (long long)n0 * f + p * FFN_PART, f, no, no, FFN_PART, LOADERS);
    }}
    copy_async_commit();
    wait_for_previous_kernel();                                // x is the kernel before's output
    float* out = partials + (long long)p * m * d;
    for (int row0 = 0; row0 < m; row0 += ROWS) {{
        const int valid = min(ROWS, m - row0);
        const bf16* xr = x + row0 * x_stride;
        float acc[2][8][4] = {{}};
        if (fc1_loader) {{
            load_rows(xs, xr, x_stride, ROWS, valid, FFN_KC, 0);
            copy_async_commit();
        }}
        for (int c = 0; c < chunks; ++c) {{
            if (fc1_loader && c + 1 < chunks) {{
                load_rows(xs + ((c + 1) & 1) * ROWS * FFN_KC, xr + (c + 1) * FFN_KC, x_stride, ROWS, valid, FFN_KC,
                          0);
                copy_async_commit();
                copy_async_wait<1>();
            }} else if (fc1_loader) {{
                copy_async_wait<0>();
            }}
            __syncthreads();
            multiply<1>(xs + (c & 1) * ROWS * FFN_KC, ws1 + c * FFN_HC * FFN_KC, FFN_KC, acc);
            __syncthreads();                                   // before the next load overwrites the chunk
        }}
        if (!fc1_loader) copy_async_wait<0>();                  // fc2's tile (from the second rows on, long done)
        cluster_barrier();             // every CTA has started, and none reads the h of the rows before any more
        share_h(hs, acc, b1 + h0, q);
        cluster_barrier();             // the partition's h is whole in every CTA
        switch (no / 32) {{
            case 1: fc2_tile<1>(out, d, n0, row0, valid, hs, ws2); break;
            case 2: fc2_tile<2>(out, d, n0, row0, valid, hs, ws2); break;
            case 4: fc2_tile<4>(out, d, n0, row0, valid, hs, ws2); break;
            case 8: fc2_tile<8>(out, d, n0, row0, valid, hs, ws2); break;
        }}
    }}
}}
"""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    from cuda.bindings import driver
    from cuda.core import Device, ObjectCode

    from bench.kernel_variant import KernelVariant
    from metrale.runtime.backend.cuda import kernels
    from metrale.runtime.backend.cuda.compiler import (KernelCache, KernelLibrary, compile_cubin, kernel_sources,
                                                       with_headers)
    from metrale.runtime.backend.cuda.device import CudaDevice, check
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch
    from metrale.runtime.backend.cuda.launch import launch_kernel
    from metrale.runtime.backend.cuda.linears import k_splits
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    cuda = CudaDevice()
    lib = KernelLibrary(cuda.arch, KernelCache(Path("/tmp/metrale-bench-kernels")))   # turns PDL on for sm_90
    norm_source = kernel_sources()["norm"]
    assert "#define MAX_PARTIALS 8" in norm_source
    wide = KernelVariant(lib, "norm", norm_source.replace("#define MAX_PARTIALS 8", "#define MAX_PARTIALS 16"))
    kernel = ObjectCode.from_cubin(compile_cubin("fused_ffn", with_headers(SOURCE), cuda.arch)).get_kernel("fused_ffn")
    shmem = shared_bytes(D_MODEL)
    check(driver.cuKernelSetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      shmem, kernel.handle, Device().device_id))
    stream = cuda.stream
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    view = DeviceTensor.from_torch
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    parts = FFN // PART
    copies = -(-L2_SPAN * l2 // (2 * D_MODEL * FFN * 2))
    w1 = (torch.randn(copies, FFN, D_MODEL, device="cuda") * D_MODEL ** -0.5).bfloat16()
    b1 = (0.1 * torch.randn(copies, FFN, device="cuda")).bfloat16()
    w2 = (torch.randn(copies, D_MODEL, FFN, device="cuda") * FFN ** -0.5).bfloat16()
    norm = [view(t) for t in ((1 + 0.1 * torch.randn(D_MODEL, device="cuda")).bfloat16(),
                              (0.1 * torch.randn(D_MODEL, device="cuda")).bfloat16())]
    try:        # clusters that fit at once: under FFN's partitions, the kernel runs in more than one wave
        from cuda.core import LaunchConfig
        resident = kernel.occupancy.max_active_clusters(
            LaunchConfig(grid=(FFN_Q, FFN // PART), block=256, shmem_size=shmem), stream=stream)
    except Exception as error:                                          # the figure is informative only
        resident = f"unknown ({type(error).__name__})"
    print(gpu_machine_line("gpu_fused_ffn", "cuda"))
    print(f"# FFN {D_MODEL} -> {FFN} -> {D_MODEL}; ours {FFN_Q * parts} CTAs in clusters of {FFN_Q}, "
          f"{kernel.attributes.num_regs} registers, {shmem // 1024} KB shared, {resident} clusters resident at once; "
          f"µs per FFN, alone and with the norm before it (ours: {parts} partials into a 16-partial norm)")
    print(f"{'rows':>4} {'cuBLASLt':>8} {'ours':>6} {'cuBLASLt chain':>14} {'ours chain':>10} {'gain':>6} "
          f"{'rel err':>8}")
    results = []
    for rows in (64, 17, 256):
        x_host = (torch.randn(rows, D_MODEL, device="cuda") * 0.5).bfloat16()
        x = view(x_host)
        h = view(torch.empty(rows, FFN, dtype=torch.bfloat16, device="cuda"))
        residual = view(torch.zeros(rows, D_MODEL, dtype=torch.bfloat16, device="cuda"))
        splits = k_splits(rows, FFN)
        theirs_partials = view(torch.zeros(splits * rows, D_MODEL, device="cuda"))
        ours_partials = torch.zeros(parts * rows, D_MODEL, device="cuda")

        def ours(i: int) -> None:
            c = i % copies
            launch_kernel(stream, kernel, (FFN_Q, parts), 256, view(ours_partials), x, np.int64(x.stride), rows,
                          view(w1[c]), view(b1[c]), view(w2[c]), D_MODEL, FFN, shmem=shmem)

        def theirs(i: int) -> None:
            c = i % copies
            lt.linear(stream, h, x, view(w1[c]), view(b1[c]), relu=True)
            lt.linear(stream, theirs_partials, h, view(w2[c]), splits=splits)

        def normed(library, partials: DeviceTensor, count: int) -> None:
            kernels.norm.layer_norm_partials(library, stream, x, partials, count, None, *norm, 1e-5, residual,
                                             residual)

        ours(0)
        theirs(0)                                                    # cuBLASLt plans its shapes outside the capture
        stream.sync()
        h_expected = torch.relu(x_host.float() @ w1[0].float().T + b1[0].float()).bfloat16()
        expected = h_expected.float() @ w2[0].float().T            # h in bf16, as cuBLASLt's fc1 writes it
        got = ours_partials.view(parts, rows, D_MODEL).sum(0)
        error = float((got - expected).abs().max() / expected.abs().max())
        row = {"rows": rows, "relative_error": error,
               "cublaslt_us": time_per_launch(stream, [lambda i=i: theirs(i) for i in range(CHAINS)]) * 1e6,
               "ours_us": time_per_launch(stream, [lambda i=i: ours(i) for i in range(CHAINS)]) * 1e6}
        row["cublaslt_chain_us"] = time_per_pair(stream, lambda i: (
            lambda: normed(lib, theirs_partials, splits), lambda: theirs(i)), CHAINS) * 1e6
        kernels.norm.MAX_PARTIALS = 16                     # the launcher's check, for the wide build's reads
        try:
            row["ours_chain_us"] = time_per_pair(stream, lambda i: (
                lambda: normed(wide, view(ours_partials), parts), lambda: ours(i)), CHAINS) * 1e6
        finally:
            kernels.norm.MAX_PARTIALS = 8
        results.append(row)
        print(format_row(row), flush=True)
    lt.close()
    return results


def format_row(row: dict) -> str:
    gain = row["cublaslt_chain_us"] - row["ours_chain_us"]
    return (f"{row['rows']:4d} {row['cublaslt_us']:8.2f} {row['ours_us']:6.2f} {row['cublaslt_chain_us']:14.2f} "
            f"{row['ours_chain_us']:10.2f} {gain:6.2f} {row['relative_error']:8.1e}")


if __name__ == "__main__":
    main()
