// The linears of a pre-norm layer's decode step, each with the norm before it or the residual add after it fused
// in, on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate). M2M100's decoder layer is three norms, each
// followed by a linear, and three linears, each followed by a residual add: fused, the norms' launches and the
// idle gaps around them go, and every linear's weight streams in while the kernel before it still runs.
//
//   fused_linear_norm[_relu]: out = [relu](layer_norm(x) @ weight^T + bias). Each row's mean and 1/std come from
//     the statistics the residual kernel left for x (stats_in); the norm is applied as x is staged, by norm.cu's
//     layer_norm formula in fp32, rounded to bf16 before the product, as the separate norm would round it.
//   fused_linear_residual: out = residual + bf16(x @ weight^T + bias), rounded twice, as a model adds two bf16
//     tensors; and for every row and 64-column tile of out, the mean and the sum of squared deviations of its 64
//     bf16 values: stats_out [N / 64][m] float2, which the next norm combines (Chan, Golub and LeVeque's pairwise
//     update, in tile order: deterministic, and without the cancellation of a sum of squares).
//
// x [m, K] bf16, row stride x_stride (elements, a multiple of 8); weight [N, K] bf16, contiguous; bias [N] bf16
// or null; out [m, N] bf16, row stride out_stride; residual [m, N] bf16, row stride residual_stride. N % 64 == 0;
// pointers 16-byte aligned, out's and residual's rows 8-byte aligned. out aliases neither x nor residual.
//
// Grid (N / 64, splits, ceil(m / 64)) of 128 threads; splits in {1, 2, 4, 8}, launched as clusters of
// (1, splits, 1) when above 1 (sm_90). CTA (tile, split, rows) owns out's 64 x 64 tile at rows 64 * rows and
// columns 64 * tile, over K [split * k_per_cta, + k_per_cta), k_per_cta a power of two from 32 to PASS_K or a
// multiple of PASS_K, in passes of up to PASS_K. Warp w computes columns 16 w .. 16 w + 15 for the 64 rows as out^T = weight @ x^T with gemv.cu's
// permuted-k fragments: lane (g, t) holds 16-byte chunk c of weight rows g and g + 8 (the A fragments of two
// mmas, straight from global memory into registers) and the same chunk of x row 8 j + g for each of the 8 row
// tiles j (B, from shared memory). A pass's weight, up to 8 steps of 32 k, is loaded at once; the first pass's
// before griddepcontrol.wait: no kernel writes a weight, so it streams in while the kernel before drains.
// x is staged by cp.async, [64 rows][PASS_K + 32]: the 64-byte pad puts the two rows a quarter-warp reads in
// different bank halves.
//
// The splits of a tile meet in distributed shared memory: each CTA leaves its fp32 partial tile in its own shared
// memory, the cluster meets at a barrier, and CTA r sums rows [r, r + 1) * 64 / splits of the tile over the
// cluster's CTAs in rank order (the same order whoever finishes last), adds the epilogue and writes them: no
// global partials, no counters, no reduce kernel.
#include "common.cuh"
#include "tensor_core.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int TILE_N = 16 * WARPS;       // output columns (weight rows) of a CTA
constexpr int TILE_M = 64;               // rows of x and out of a CTA: 8 mma tiles of 8
constexpr int PASS_K = 256;              // k staged at once
constexpr int STEPS = PASS_K / 32;       // a warp's 32-k steps in a full pass
constexpr int X_STRIDE = PASS_K + 32;    // bf16 between rows of staged x
constexpr int ACC_STRIDE = TILE_N + 4;   // floats between rows of the partial tile
constexpr int STATS_WIDTH = 64;          // columns a row statistic covers (= TILE_N)
constexpr int MAX_SPLITS = 8;            // CTAs a tile's K is split over: a portable cluster
constexpr int MAX_ITEMS = TILE_M * 16 / THREADS;   // 4-column items of the epilogue a thread takes, unsplit

enum Epilogue { NORM = 0, NORM_RELU = 1, RESIDUAL = 2 };

struct Shared {
    union {
        bf16 x[TILE_M * X_STRIDE];
        float acc[TILE_M * ACC_STRIDE];  // the CTA's partial tile, once x is spent
    };
    bf16 norm_weight[PASS_K], norm_bias[PASS_K];   // the pass's slice of the norm's vectors
    float mean[TILE_M], rstd[TILE_M];
};

__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// 4 floats at `local`'s offset in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float4 load_from_cta(const float* local, unsigned rank) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote));
#else
    __trap();   // the launcher splits only on sm_90 and later
#endif
    return v;
}

// One pass's weight for this lane: steps of 32 k, chunk t of each step, rows g and g + 8 of the warp's 16.
__device__ __forceinline__ void load_pass_weight(uint4 (&low)[STEPS], uint4 (&high)[STEPS], const uint4* row_low,
                                                 const uint4* row_high, int steps) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
        low[s] = load_weight(row_low + 4 * s, s < steps);
        high[s] = load_weight(row_high + 4 * s, s < steps);
    }
}

// Each of the CTA's rows' mean and 1/std over K into shared memory, from the K / 64 tile statistics: the mean of
// the tile means, and the tiles' squared deviations plus 64 (tile mean - mean)^2 each (equal tiles: no division,
// and every sum a short chain). Rows past m get 0 and 0. Visible to the CTA after its next barrier.
__device__ __forceinline__ void row_norms(Shared& shared, const float2* stats, int m, int row0, int k, float eps) {
    if (threadIdx.x < TILE_M) {
        const int row = row0 + threadIdx.x, tiles = k / STATS_WIDTH;
        float mean = 0.f, squares = 0.f;
        if (row < m) {
            const float2* column = stats + row;
#pragma unroll 16
            for (int tile = 0; tile < tiles; ++tile) mean += column[(long long)tile * m].x;
            mean /= (float)tiles;
#pragma unroll 16
            for (int tile = 0; tile < tiles; ++tile) {
                const float2 s = column[(long long)tile * m];
                squares += s.y + STATS_WIDTH * (s.x - mean) * (s.x - mean);
            }
        }
        shared.mean[threadIdx.x] = mean;
        shared.rstd[threadIdx.x] = row < m ? rsqrtf(squares / (float)k + eps) : 0.f;
    }
}

// A pass's length is a power of two from 32 to PASS_K (the launcher's splits make it so), so its 16-byte chunks
// split evenly over the threads: each thread takes one chunk column kc of rows r0, r0 + step, ...
struct PassChunks {
    int kc, r0, step;
    __device__ __forceinline__ explicit PassChunks(int len) {
        const int row_chunks = len >> 3;
        kc = threadIdx.x & (row_chunks - 1);
        r0 = threadIdx.x / row_chunks;
        step = THREADS / row_chunks;
    }
};

// cp.async of x [row0, + 64) x [k0, + len) into shared memory, rows past m zero-filled. Not committed.
__device__ __forceinline__ void issue_x(Shared& shared, const bf16* x, long long x_stride, int m, int row0, int k0,
                                        int len) {
    const PassChunks chunks(len);
    const bf16* column = x + k0 + 8 * chunks.kc;
    for (int r = chunks.r0; r < TILE_M; r += chunks.step) {
        const bool valid = row0 + r < m;
        copy_async_16(&shared.x[r * X_STRIDE + 8 * chunks.kc], column + (valid ? row0 + r : 0) * x_stride, valid);
    }
}

// cp.async of the norm's vectors [k0, + len) into shared memory. Not committed.
__device__ __forceinline__ void issue_norm_vectors(Shared& shared, const bf16* norm_weight, const bf16* norm_bias,
                                                   int k0, int len) {
    const int row_chunks = len >> 3;
    if (threadIdx.x < 2 * row_chunks) {
        const bool second = threadIdx.x >= row_chunks;
        const int kc = second ? threadIdx.x - row_chunks : threadIdx.x;
        copy_async_16((second ? shared.norm_bias : shared.norm_weight) + 8 * kc,
                      (second ? norm_bias : norm_weight) + k0 + 8 * kc, true);
    }
}

// Waits for the pass's copies; where NORMED, normalizes staged x in place by the rows' statistics (norm.cu's
// layer_norm formula), reading shared memory only. Ends with a barrier: x is ready for every warp.
template <bool NORMED>
__device__ __forceinline__ void finish_x(Shared& shared, int len) {
    copy_async_wait<0>();
    __syncthreads();
    if (NORMED) {
        const PassChunks chunks(len);
        float w[8], b[8];
        unpack8(reinterpret_cast<const uint4*>(shared.norm_weight)[chunks.kc], w);
        unpack8(reinterpret_cast<const uint4*>(shared.norm_bias)[chunks.kc], b);
#pragma unroll 4
        for (int r = chunks.r0; r < TILE_M; r += chunks.step) {
            uint4* chunk = reinterpret_cast<uint4*>(&shared.x[r * X_STRIDE + 8 * chunks.kc]);
            float v[8];
            unpack8(*chunk, v);
            const float mean = shared.mean[r], rstd = shared.rstd[r];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = (v[i] - mean) * rstd * w[i] + b[i];
            *chunk = pack8(v);
        }
        __syncthreads();
    }
}

// acc[j] += this warp's 16 weight rows x staged rows 8 j .. 8 j + 7, over `steps` steps of the pass.
__device__ __forceinline__ void multiply(float (&acc)[8][4], const uint4 (&low)[STEPS], const uint4 (&high)[STEPS],
                                         const bf16* x_tile, int g, int t, int steps) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
        if (s >= steps) break;
        const unsigned a0[4] = {low[s].x, high[s].x, low[s].y, high[s].y};
        const unsigned a1[4] = {low[s].z, high[s].z, low[s].w, high[s].w};
        const bf16* column = x_tile + g * X_STRIDE + 8 * (4 * s + t);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint4 b = *reinterpret_cast<const uint4*>(column + 8 * j * X_STRIDE);
            mma_bf16(acc[j], a0, b.x, b.y);
            mma_bf16(acc[j], a1, b.z, b.w);
        }
    }
}

template <int EPILOGUE>
__device__ __forceinline__ void fused_linear(bf16* out, long long out_stride, const bf16* x, long long x_stride,
                                             const bf16* weight, const bf16* bias, const bf16* residual,
                                             long long residual_stride, const float2* stats_in,
                                             const bf16* norm_weight, const bf16* norm_bias, float eps,
                                             float2* stats_out, int m, int k, int k_per_cta) {
    __shared__ __align__(16) Shared shared;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int col0 = blockIdx.x * TILE_N, row0 = blockIdx.z * TILE_M;
    const int split = blockIdx.y, splits = gridDim.y;
    const int k_begin = split * k_per_cta, k_end = k_begin + k_per_cta;
    const long long row_chunks = k >> 3;
    const uint4* w_low = reinterpret_cast<const uint4*>(weight) + (col0 + 16 * warp + g) * row_chunks
                         + (k_begin >> 3) + t;
    const uint4* w_high = w_low + 8 * row_chunks;
    constexpr bool NORMED = EPILOGUE != RESIDUAL;
    // The epilogue's share of the tile: rows [split, split + 1) * rows, 16 threads a row, 4 columns each (the
    // same 4 in every item of a thread: THREADS is a multiple of 16). At most 8 splits, so every thread has the
    // same number of items and the 16-lane shuffles of the epilogue see whole rows.
    const int rows = TILE_M / splits, items = rows * 16 / THREADS, c_item = 4 * (threadIdx.x & 15);

    // Before the wait, what no kernel writes: the first pass's weight, the bias of the epilogue's columns, the
    // norm's vectors for the first pass.
    uint4 a_low[STEPS], a_high[STEPS];
    const int first_len = min(PASS_K, k_per_cta);
    load_pass_weight(a_low, a_high, w_low, w_high, first_len >> 5);
    const uint2 bias4 = bias != nullptr ? *reinterpret_cast<const uint2*>(bias + col0 + c_item) : make_uint2(0u, 0u);
    if (NORMED) issue_norm_vectors(shared, norm_weight, norm_bias, k_begin, first_len);

    wait_for_previous_kernel();
    // Then every read of the previous kernels' outputs at once: x's first pass, the rows' statistics (norm), the
    // residual of the epilogue's items (residual).
    issue_x(shared, x, x_stride, m, row0, k_begin, first_len);
    copy_async_commit();
    uint2 residuals[MAX_ITEMS];
    if (EPILOGUE == RESIDUAL) {
#pragma unroll
        for (int i = 0; i < MAX_ITEMS; ++i) {
            if (i >= items) break;
            const int row = row0 + split * rows + ((threadIdx.x + i * THREADS) >> 4);
            residuals[i] = row < m ? *reinterpret_cast<const uint2*>(residual + row * residual_stride + col0 + c_item)
                                   : make_uint2(0u, 0u);
        }
    }
    if (NORMED) row_norms(shared, stats_in, m, row0, k, eps);

    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int k0 = k_begin, len = first_len;;) {
        finish_x<NORMED>(shared, len);
        multiply(acc, a_low, a_high, shared.x, g, t, len >> 5);
        k0 += PASS_K;
        if (k0 >= k_end) break;
        len = min(PASS_K, k_end - k0);
        __syncthreads();   // x is spent
        load_pass_weight(a_low, a_high, w_low + ((k0 - k_begin) >> 3), w_high + ((k0 - k_begin) >> 3), len >> 5);
        if (NORMED) issue_norm_vectors(shared, norm_weight, norm_bias, k0, len);
        issue_x(shared, x, x_stride, m, row0, k0, len);
        copy_async_commit();
    }
    __syncthreads();   // x is spent: the partial tile overwrites it

    // acc[j]: columns 16 warp + (g, g + 8) of the tile, rows 8 j + (2t, 2t + 1).
    float* tile = shared.acc;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int r = 8 * j + 2 * t, c = 16 * warp + g;
        tile[r * ACC_STRIDE + c] = acc[j][0];
        tile[(r + 1) * ACC_STRIDE + c] = acc[j][1];
        tile[r * ACC_STRIDE + c + 8] = acc[j][2];
        tile[(r + 1) * ACC_STRIDE + c + 8] = acc[j][3];
    }
    if (splits > 1) cluster_sync(); else __syncthreads();

    // The split partial tiles summed in rank order, every rank's load issued before any is added.
    float4 sums[MAX_ITEMS];
#pragma unroll
    for (int i = 0; i < MAX_ITEMS; ++i) {
        if (i >= items) break;
        const float* at = &tile[(split * rows + ((threadIdx.x + i * THREADS) >> 4)) * ACC_STRIDE + c_item];
        if (splits > 1) {
            float4 parts[MAX_SPLITS];
#pragma unroll
            for (int rank = 0; rank < MAX_SPLITS; ++rank)
                if (rank < splits) parts[rank] = load_from_cta(at, rank);
            sums[i] = parts[0];
#pragma unroll
            for (int rank = 1; rank < MAX_SPLITS; ++rank) {
                if (rank < splits) {
                    sums[i].x += parts[rank].x; sums[i].y += parts[rank].y;
                    sums[i].z += parts[rank].z; sums[i].w += parts[rank].w;
                }
            }
        } else {
            sums[i] = *reinterpret_cast<const float4*>(at);
        }
    }
#pragma unroll
    for (int i = 0; i < MAX_ITEMS; ++i) {
        if (i >= items) break;
        const int item = threadIdx.x + i * THREADS;
        const int r = split * rows + (item >> 4), c = 4 * (item & 15);
        const int row = row0 + r, col = col0 + c;
        const bool valid = row < m;
        const float2 b01 = bf16x2_to_float2(bias4.x), b23 = bf16x2_to_float2(bias4.y);
        float y[4] = {sums[i].x + b01.x, sums[i].y + b01.y, sums[i].z + b23.x, sums[i].w + b23.y};
        if (EPILOGUE == NORM_RELU) {
#pragma unroll
            for (int j = 0; j < 4; ++j) y[j] = fmaxf(y[j], 0.f);
        }
        if (EPILOGUE == RESIDUAL) {
            const float2 r01 = bf16x2_to_float2(residuals[i].x), r23 = bf16x2_to_float2(residuals[i].y);
            const float add[4] = {r01.x, r01.y, r23.x, r23.y};
#pragma unroll
            for (int j = 0; j < 4; ++j) y[j] = bf16_to_float(float_to_bf16(bf16_to_float(float_to_bf16(y[j])) + add[j]));
        }
        if (valid) {
            *reinterpret_cast<uint2*>(out + row * out_stride + col) =
                make_uint2(float2_to_bf16x2(y[0], y[1]), float2_to_bf16x2(y[2], y[3]));
        }
        if (EPILOGUE == RESIDUAL) {
            // The row's 64 columns of this tile are the 16 lanes of a half-warp.
            float s = y[0] + y[1] + y[2] + y[3];
#pragma unroll
            for (int offset = 1; offset < 16; offset <<= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
            const float mean = s * (1.f / STATS_WIDTH);
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) d += (y[j] - mean) * (y[j] - mean);
#pragma unroll
            for (int offset = 1; offset < 16; offset <<= 1) d += __shfl_xor_sync(0xffffffffu, d, offset);
            if (valid && (lane & 15) == 0) stats_out[(long long)blockIdx.x * m + row] = make_float2(mean, d);
        }
    }
    if (splits > 1) cluster_sync();   // no CTA leaves while another still reads its shared memory
}

}  // namespace

// stats: the residual kernel's [K / 64][m] float2 for x (K % 64 == 0).
extern "C" __global__ void __launch_bounds__(THREADS) fused_linear_norm(
    bf16* out, long long out_stride, const bf16* x, long long x_stride, const bf16* weight, const bf16* bias,
    const float2* stats, const bf16* norm_weight, const bf16* norm_bias, float eps, int m, int k, int k_per_cta) {
    fused_linear<NORM>(out, out_stride, x, x_stride, weight, bias, nullptr, 0, stats, norm_weight, norm_bias, eps,
                       nullptr, m, k, k_per_cta);
}

extern "C" __global__ void __launch_bounds__(THREADS) fused_linear_norm_relu(
    bf16* out, long long out_stride, const bf16* x, long long x_stride, const bf16* weight, const bf16* bias,
    const float2* stats, const bf16* norm_weight, const bf16* norm_bias, float eps, int m, int k, int k_per_cta) {
    fused_linear<NORM_RELU>(out, out_stride, x, x_stride, weight, bias, nullptr, 0, stats, norm_weight, norm_bias,
                            eps, nullptr, m, k, k_per_cta);
}

// stats: [N / 64][m] float2 out.
extern "C" __global__ void __launch_bounds__(THREADS) fused_linear_residual(
    bf16* out, long long out_stride, const bf16* x, long long x_stride, const bf16* weight, const bf16* bias,
    const bf16* residual, long long residual_stride, float2* stats, int m, int k, int k_per_cta) {
    fused_linear<RESIDUAL>(out, out_stride, x, x_stride, weight, bias, residual, residual_stride, nullptr, nullptr,
                           nullptr, 0.f, stats, m, k, k_per_cta);
}
