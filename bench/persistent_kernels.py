"""The CUDA sources of the persistent-kernel prototypes (docs/persistent_decoder.md) and the host's view of their
layouts: the grid barriers (gpu_grid_barrier.py) and a linear as a split-K phase on tensor cores
(gpu_persistent_gemm.py), whose parts persistent_layer_kernel.py builds a decoder layer on."""

from dataclasses import dataclass

import numpy as np

# The barrier every phase ends at. FENCED: thread 0 of each CTA fences, adds 1 to the counter and spins until it
# reaches the round's target, then fences again; otherwise it adds with release semantics and polls with acquire
# loads (no full fences).
BARRIER = r"""
template <bool FENCED>
__device__ __forceinline__ void grid_barrier(unsigned int* counter, unsigned int target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (FENCED) {
            __threadfence();
            atomicAdd(counter, 1u);
            while (*reinterpret_cast<volatile unsigned int*>(counter) < target) {}
            __threadfence();
        } else {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
            unsigned int seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            } while (seen < target);
        }
    }
    __syncthreads();
}

"""

# A linear's split-K phase: its tile's layout, loads, mma and partials.
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
""" + BARRIER

GRID_PHASES = BARRIER + r"""
template <bool FENCED>
__device__ __forceinline__ void run_phases(const uint4* weights, long long weight_units, long long units_per_phase,
                                           unsigned int* counter, int rounds, float* sink) {
    unsigned int target = 0;
    float acc = 0.f;
    const long long per_cta = units_per_phase / gridDim.x;
    for (int r = 0; r < rounds; ++r) {
        const long long base =
            units_per_phase ? ((long long)r * units_per_phase) % (weight_units - units_per_phase) : 0;
        const uint4* mine = weights + base + blockIdx.x * per_cta;
#pragma unroll 4
        for (long long i = threadIdx.x; i < per_cta; i += blockDim.x) {
            const uint4 v = mine[i];
            acc += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
        }
        target += gridDim.x;
        grid_barrier<FENCED>(counter, target);
    }
    if (acc == 12345.f) sink[0] = acc;
}

extern "C" __global__ void phases(const uint4* weights, long long weight_units, long long units_per_phase,
                                  unsigned int* counter, int rounds, float* sink) {
    run_phases<true>(weights, weight_units, units_per_phase, counter, rounds, sink);
}

extern "C" __global__ void phases_acquire(const uint4* weights, long long weight_units, long long units_per_phase,
                                          unsigned int* counter, int rounds, float* sink) {
    run_phases<false>(weights, weight_units, units_per_phase, counter, rounds, sink);
}
"""

GEMM_PHASES = PHASE_PARTS + r"""
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
        grid_barrier<true>(counter, (unsigned int)((r + 1) * gridDim.x));
    }
}
"""

CTAS = 128                 # one an SM: the barrier needs them all resident
THREADS = 256
TILE_BYTES = 64 * 1024
SHARED_BYTES = 3 * TILE_BYTES
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


