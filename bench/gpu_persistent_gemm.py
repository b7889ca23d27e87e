"""What a linear costs as a phase of a persistent kernel, at a 16-request beam step's 64 rows: the question before a
persistent decoder layer (bench/NOTES.md, sessions 9 and 14). Needs a CUDA GPU (sm_80 or later).

One CTA per SM (128 of them), each phase a linear's split-K share: CTA (n tile, K slice) multiplies x's K slice
[64, k_slice] by its weight tile [n_tile, k_slice] on tensor cores (mma.sync m16n8k16, bf16 in, fp32 out) and
writes the fp32 partial [64, n_tile] of its slice (the next phase would sum the slices, as layer_norm_partials
sums cuBLASLt's). Then a grid-wide barrier, as between a layer's dependent steps. With `prefetch` the next phase's
weight tile is copied into shared memory (cp.async) while this phase runs, so a phase waits only for x's slice,
which in a real layer the phase before writes; without it the weight comes after the barrier with x. Each
phase's weight is the next copy of it in a pool over 512 MiB, so every phase reads it from HBM, as a step does.

A phase's time is (time of 1 + ROUNDS phases - time of 1) / ROUNDS; against it, cuBLASLt's per-launch times in
the step's kernel table (session 14, PDL off): the 1024 x 1024 linears as 4 K-slice partials 3.41 us, qkv 5.46,
fc1 5.81, fc2 as partials 5.47, each after ~0.5 us of idle device (cuBLASLt does not take part in PDL).

Run from the repository root: python3 -m bench.gpu_persistent_gemm
"""

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line

# The phase's parts, shared with bench/gpu_persistent_layer.py.
PHASE_PARTS = r"""
#include "mma.cuh"

// A linear's split over the CTAs: CTA c multiplies the weight tile [n_tile, k_slice] at (n0, k0) against x's K
// slice and writes the fp32 partial of slice k_block = c / (n / n_tile). The weight is copy (`copy` % copies) of
// the pool at w (copy_elems apart), so that successive phases read different copies from HBM.
struct Phase {
    const bf16* w;
    long long copy_elems;
    long long copies;
    float* partial;             // [k / k_slice, ROWS, n]
    int n, k, n_tile, k_slice;
};

constexpr int ROWS = 64, THREADS = 256;
constexpr int TILE_BYTES = 64 * 1024;      // a weight tile's and an x slice's most shared memory

__device__ __forceinline__ int tile_n0(const Phase& p) { return (blockIdx.x % (p.n / p.n_tile)) * p.n_tile; }
__device__ __forceinline__ int tile_k_block(const Phase& p) { return blockIdx.x / (p.n / p.n_tile); }

// 16-byte chunk c of tile row r sits at chunk c ^ 4 on odd rows: a quarter-warp's 16-byte reads of two rows then
// fall in eight different bank groups.
__device__ __forceinline__ int swizzled(int row, int chunk, int chunks) {
    return row * chunks + (chunk ^ ((row & 1) << 2));
}

// rows x (cols / 8) chunks of a row-major bf16 matrix (row stride `stride`) into shared memory, swizzled.
__device__ __forceinline__ void load_tile(bf16* shared, const bf16* global, long long stride, int rows, int cols) {
    const int chunks = cols / 8;
    for (int i = threadIdx.x; i < rows * chunks; i += THREADS) {
        const int row = i / chunks, chunk = i % chunks;
        copy_async_16(shared + 8 * swizzled(row, chunk, chunks), global + row * stride + 8 * chunk, true);
    }
}

__device__ __forceinline__ void load_weight_tile(bf16* shared, const Phase& p, long long copy) {
    const bf16* w = p.w + (copy % p.copies) * p.copy_elems + (long long)tile_n0(p) * p.k + tile_k_block(p) * p.k_slice;
    load_tile(shared, w, p.k, p.n_tile, p.k_slice);
}

__device__ __forceinline__ void grid_barrier(unsigned int* counter, unsigned int target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (*reinterpret_cast<volatile unsigned int*>(counter) < target) {}
        __threadfence();
    }
    __syncthreads();
}

// Warps 2 (rows: 32 each, two m16 tiles) x 4 (columns: n_tile / 4 each, NT n8 tiles). K goes 32 at a time: lane
// (g, t) reads 16 bytes, columns 8t .. 8t + 7 of the chunk, of each of its A rows and B columns, and feeds them to
// two mma.sync as their k pairs (2t, 2t + 1) and (2t + 8, 2t + 9): A and B take the same permutation of K.
template <int NT>
__device__ __forceinline__ void multiply(const bf16* xs, const bf16* ws, int k_slice, float (&acc)[2][8][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = (warp & 1) * 32, col0 = (warp >> 1) * NT * 8, chunks = k_slice / 8;
    for (int kc = 0; kc < chunks; kc += 4) {
        uint4 a[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + 16 * m + g + 8 * h;
                a[m][h] = reinterpret_cast<const uint4*>(xs)[swizzled(row, kc + t, chunks)];
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int col = col0 + 8 * j + g;
            const uint4 b = reinterpret_cast<const uint4*>(ws)[swizzled(col, kc + t, chunks)];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const unsigned first[4] = {a[m][0].x, a[m][1].x, a[m][0].y, a[m][1].y};
                const unsigned second[4] = {a[m][0].z, a[m][1].z, a[m][0].w, a[m][1].w};
                mma_bf16(acc[m][j], first, b.x, b.y);
                mma_bf16(acc[m][j], second, b.z, b.w);
            }
        }
    }
}

template <int NT>
__device__ __forceinline__ void store(const Phase& p, const float (&acc)[2][8][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* out = p.partial + (long long)tile_k_block(p) * ROWS * p.n + tile_n0(p) + (warp >> 1) * NT * 8 + 2 * t;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int row = (warp & 1) * 32 + 16 * m + g;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            *reinterpret_cast<float2*>(out + (long long)row * p.n + 8 * j) = make_float2(acc[m][j][0], acc[m][j][1]);
            *reinterpret_cast<float2*>(out + (long long)(row + 8) * p.n + 8 * j) =
                make_float2(acc[m][j][2], acc[m][j][3]);
        }
    }
}

template <int NT>
__device__ __forceinline__ void run_tile(const Phase& p, const bf16* xs, const bf16* ws) {
    float acc[2][8][4] = {};
    multiply<NT>(xs, ws, p.k_slice, acc);
    store<NT>(p, acc);
}

// The CTA's tile of the phase, its weight and x's slice in shared memory: NT = n_tile / 32.
__device__ __forceinline__ void multiply_tile(const Phase& p, const bf16* xs, const bf16* ws) {
    switch (p.n_tile / 32) {
        case 1: run_tile<1>(p, xs, ws); break;
        case 2: run_tile<2>(p, xs, ws); break;
        case 3: run_tile<3>(p, xs, ws); break;
        case 4: run_tile<4>(p, xs, ws); break;
        case 6: run_tile<6>(p, xs, ws); break;
        case 8: run_tile<8>(p, xs, ws); break;
    }
}
"""

SOURCE = PHASE_PARTS + r"""
// rounds phases, phase r = phases[r % num_phases] on weight copy r / num_phases; x [64, x_stride] bf16. Dynamic
// shared memory: two weight tiles and x's slice, TILE_BYTES each.
extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_phases(
        const Phase* phases, int num_phases, int rounds, const bf16* x, long long x_stride, unsigned int* counter,
        int prefetch) {
    extern __shared__ __align__(128) unsigned char shared[];
    bf16* xs = reinterpret_cast<bf16*>(shared + 2 * TILE_BYTES);
    if (prefetch) {
        load_weight_tile(reinterpret_cast<bf16*>(shared), phases[0], 0);
        copy_async_commit();
    }
    for (int r = 0; r < rounds; ++r) {
        const Phase& p = phases[r % num_phases];
        bf16* ws = reinterpret_cast<bf16*>(shared + (r & 1) * TILE_BYTES);
        load_tile(xs, x + tile_k_block(p) * p.k_slice, x_stride, ROWS, p.k_slice);
        if (!prefetch) load_weight_tile(ws, p, r / num_phases);
        copy_async_commit();
        if (prefetch && r + 1 < rounds) {         // the next phase's weight, while this one runs
            load_weight_tile(reinterpret_cast<bf16*>(shared + ((r + 1) & 1) * TILE_BYTES),
                             phases[(r + 1) % num_phases], (r + 1) / num_phases);
        }
        copy_async_commit();                          // (empty where nothing was prefetched)
        copy_async_wait<1>();
        __syncthreads();
        multiply_tile(p, xs, ws);
        grid_barrier(counter, (unsigned int)((r + 1) * gridDim.x));
    }
}
"""

CTAS = 128
THREADS = 256
TILE_BYTES = 64 * 1024
SHARED_BYTES = 3 * TILE_BYTES
ROUNDS = 120
POOL_BYTES = 512 << 20
ROWS = 64
PHASE_DTYPE = np.dtype([("w", np.uint64), ("copy_elems", np.int64), ("copies", np.int64), ("partial", np.uint64),
                        ("n", np.int32), ("k", np.int32), ("n_tile", np.int32), ("k_slice", np.int32)])


@dataclass(frozen=True)
class Split:
    """A linear [n, k] over the CTAs: n / n_tile tiles times k / k_slice slices."""
    name: str
    n: int
    k: int
    n_tile: int
    k_slice: int

    def check(self) -> None:
        assert self.n % self.n_tile == 0 and self.k % self.k_slice == 0, self
        assert (self.n // self.n_tile) * (self.k // self.k_slice) == CTAS, self
        assert self.n_tile // 32 in (1, 2, 3, 4, 6, 8) and self.n_tile % 32 == 0 and self.k_slice % 32 == 0, self
        assert self.n_tile * self.k_slice * 2 <= TILE_BYTES and ROWS * self.k_slice * 2 <= TILE_BYTES, self


# NLLB-200-600M's decoder linears (cuBLASLt's per-launch time in the step, us, for the table).
SPLITS = [Split("o / cross q 1024 x 1024", 1024, 1024, 64, 128), Split("o / cross q 1024 x 1024", 1024, 1024, 32, 256),
          Split("qkv 3072 x 1024", 3072, 1024, 96, 256), Split("qkv 3072 x 1024", 3072, 1024, 192, 128),
          Split("fc1 4096 x 1024", 4096, 1024, 128, 256), Split("fc1 4096 x 1024", 4096, 1024, 256, 128),
          Split("fc2 1024 x 4096", 1024, 4096, 64, 512), Split("fc2 1024 x 4096", 1024, 4096, 128, 256)]
CUBLAS_US = {"o / cross q 1024 x 1024": 3.41, "qkv 3072 x 1024": 5.46, "fc1 4096 x 1024": 5.81,
             "fc2 1024 x 4096": 5.47}
# A decoder layer's linears in order, as one sequence of phases.
LAYER = [SPLITS[2], SPLITS[0], SPLITS[0], SPLITS[0], SPLITS[4], SPLITS[6]]


@dataclass
class Row:
    name: str
    n_tile: int
    k_slice: int
    prefetch_us: float
    plain_us: float
    relative_error: float


def persistent_kernel(name: str, source: str, entry: str):
    """(CudaDevice, the kernel) compiled for this GPU, allowed SHARED_BYTES of dynamic shared memory; its CTAS CTAs
    must all be resident at once (one an SM) for the grid barrier not to hang."""
    from cuda.bindings import driver
    from cuda.core import Device, ObjectCode

    from metrale.runtime.backend.cuda.compiler import compile_cubin, with_headers
    from metrale.runtime.backend.cuda.device import CudaDevice, check

    cuda = CudaDevice()
    assert Device().properties.multiprocessor_count >= CTAS, "one CTA per SM: the barrier needs them all resident"
    kernel = ObjectCode.from_cubin(compile_cubin(name, with_headers(source), cuda.arch)).get_kernel(entry)
    check(driver.cuKernelSetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      SHARED_BYTES, kernel.handle, Device().device_id))
    return cuda, kernel


def main(argv=None) -> list[dict]:
    from cuda.core import EventOptions, LaunchConfig, launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for split in SPLITS:
        split.check()

    print(gpu_machine_line("gpu_persistent_gemm", "cuda"))
    cuda, kernel = persistent_kernel("persistent_gemm", SOURCE, "gemm_phases")
    stream, timing = cuda.stream, EventOptions(timing_enabled=True)
    x = (torch.randn(ROWS, 4096, device="cuda") * 0.5).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    pools, partials = {}, {}

    def pool(split: Split) -> torch.Tensor:
        key = (split.n, split.k)
        if key not in pools:
            copies = max(2, POOL_BYTES // (split.n * split.k * 2))
            pools[key] = (torch.randn(copies, split.n, split.k, device="cuda") * 0.05).bfloat16()
        return pools[key]

    def phases_of(sequence: list[Split]) -> torch.Tensor:
        table = np.zeros(len(sequence), dtype=PHASE_DTYPE)
        for i, split in enumerate(sequence):
            weights = pool(split)
            out = partials.setdefault(i, {}).setdefault(
                split, torch.zeros(split.k // split.k_slice, ROWS, split.n, device="cuda"))
            table[i] = (weights.data_ptr(), split.n * split.k, weights.shape[0], out.data_ptr(), split.n, split.k,
                        split.n_tile, split.k_slice)
        return torch.from_numpy(table.view(np.uint8)).cuda()

    def elapsed_ms(phases: torch.Tensor, count: int, rounds: int, prefetch: bool) -> float:
        counter.zero_()
        torch.cuda.synchronize()
        start = stream.record(options=timing)
        launch(stream, LaunchConfig(grid=CTAS, block=THREADS, shmem_size=SHARED_BYTES), kernel,
               np.uint64(phases.data_ptr()), np.int32(count), np.int32(rounds), np.uint64(x.data_ptr()),
               np.int64(x.stride(0)), np.uint64(counter.data_ptr()), np.int32(int(prefetch)))
        end = stream.record(options=timing)
        end.sync()
        return end - start

    def phase_us(sequence: list[Split], prefetch: bool) -> float:
        phases = phases_of(sequence)
        elapsed_ms(phases, len(sequence), len(sequence), prefetch)                        # warm-up
        one = min(elapsed_ms(phases, len(sequence), len(sequence), prefetch) for _ in range(3))
        many = min(elapsed_ms(phases, len(sequence), len(sequence) * (ROUNDS + 1), prefetch) for _ in range(3))
        return (many - one) * 1e3 / (ROUNDS * len(sequence))

    def relative_error(split: Split) -> float:
        phases = phases_of([split])
        elapsed_ms(phases, 1, 1, True)
        torch.cuda.synchronize()
        ours = partials[0][split].sum(dim=0)
        expected = x[:, :split.k].float() @ pool(split)[0].float().T
        return float((ours - expected).abs().max() / expected.abs().max())

    print(f"kernel: {kernel.attributes.num_regs} registers a thread, {SHARED_BYTES} bytes of shared memory, "
          f"{CTAS} CTAs x {THREADS} threads; {ROUNDS} phases timed after one")
    print(f"{'linear':<26} {'n_tile':>6} {'k_slice':>7} {'prefetch us':>11} {'plain us':>8} {'cuBLASLt us':>11} "
          f"{'rel err':>8}")
    rows = []
    for split in SPLITS:
        row = Row(split.name, split.n_tile, split.k_slice, phase_us([split], True), phase_us([split], False),
                  relative_error(split))
        rows.append(row)
        print(f"{row.name:<26} {row.n_tile:>6} {row.k_slice:>7} {row.prefetch_us:11.2f} {row.plain_us:8.2f} "
              f"{CUBLAS_US[split.name]:11.2f} {row.relative_error:8.1e}", flush=True)
    layer_prefetch, layer_plain = phase_us(LAYER, True) * len(LAYER), phase_us(LAYER, False) * len(LAYER)
    cublas = sum(CUBLAS_US[s.name] for s in LAYER)
    print(f"a layer's {len(LAYER)} linears as phases: {layer_prefetch:.2f} us with prefetch, {layer_plain:.2f} "
          f"without; cuBLASLt {cublas:.2f} us of launches (+ ~0.5 us idle before each)")
    result = {"rows": [asdict(r) for r in rows], "layer_prefetch_us": layer_prefetch, "layer_plain_us": layer_plain}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return [asdict(r) for r in rows]


if __name__ == "__main__":
    main()
