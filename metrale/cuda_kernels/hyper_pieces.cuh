// hyper.cu's projection of a token's streams, the part of its kernels that reads the weights: a hyper-connection's
// fn rows dotted with the RMS-normed flattened streams, by one CTA per token or, for a few tokens, by several CTAs
// each holding a piece of the row, whose dot products meet in global memory (gather_dots).
#pragma once
#include "common.cuh"

#define HYPER_THREADS 256
#define HYPER_WARPS (HYPER_THREADS / 32)
#define HYPER_MAX_STREAMS 8
#define HYPER_MAX_ROWS (2 * HYPER_MAX_STREAMS + HYPER_MAX_STREAMS * HYPER_MAX_STREAMS)   // pre, post, comb logits
#define HYPER_ROW_CHUNK 16          // fn rows a thread accumulates at once (registers); more rows take more passes

__device__ __forceinline__ float unit_squares(uint4 v) {
    float f[8];
    unpack8(v, f);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += f[i] * f[i];
    return s;
}

// A hyper-connection's projection (HyperConnection, or HyperHead: rows = hc_mult, no post): fn [rows, hc_mult *
// hidden], base [rows], scale [2 or 3; 1 for the head], fp32 device pointers. comb where sinkhorn_iters > 0.
struct Connection {
    const float* fn;
    const float* base;
    const float* scale;
    int hc_mult, rows, sinkhorn_iters;
    float norm_eps, eps, post_magnitude, post_eps;
};

// A CTA's piece of a token's row: units first .. first + count - 1 of each stream (16-byte units of bf16), staged
// in shared memory as staged[k * count + j] = unit first + j of stream k. A row is split into pieces where a few
// tokens would leave most SMs idle (the launcher's slices); one piece is the whole row otherwise.
struct Piece {
    int first, count;
};

__device__ __forceinline__ Piece piece_of(int groups, int span) {
    const int first = blockIdx.y * span;
    return {first, min(span, groups - first)};
}

// The piece of a token's streams copied into shared memory; returns this thread's share of its sum of squares.
__device__ __forceinline__ float stage_piece(uint4* staged, const uint4* row, int n, int groups, Piece p) {
    float sum_squares = 0.f;
    for (int i = threadIdx.x; i < n * p.count; i += blockDim.x) {
        const int k = i / p.count;
        const uint4 v = row[k * groups + p.first + i - k * p.count];
        staged[i] = v;
        sum_squares += unit_squares(v);
    }
    return sum_squares;
}

// Each warp's partial dot products of the staged piece with fn's rows, and its share of the piece's sum of squares
// (entry rows), into partial[warp] (zero for the rows it does not take). The warps split the piece's columns (k, j)
// and, where those leave warps over, the rows; each thread reads its columns of fn, once per HYPER_ROW_CHUNK rows.
__device__ __forceinline__ void project(const uint4* staged, int groups, Piece p, const Connection& c,
                                        float sum_squares, float (*partial)[HYPER_MAX_ROWS + 1]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cols = c.hc_mult * p.count, col_warps = (cols + 31) >> 5;
    const int row_groups = max(1, min(HYPER_WARPS / col_warps, c.rows)), group_warps = HYPER_WARPS / row_groups;
    const int group = warp / group_warps, first_col = (warp % group_warps) * 32 + lane;
    const long long width = 8LL * c.hc_mult * groups;
    for (int r = lane; r < c.rows; r += 32) partial[warp][r] = 0.f;
    __syncwarp();
    for (int first = group; group < row_groups && first < c.rows; first += row_groups * HYPER_ROW_CHUNK) {
        float acc[HYPER_ROW_CHUNK];
#pragma unroll
        for (int r = 0; r < HYPER_ROW_CHUNK; ++r) acc[r] = 0.f;
        for (int col = first_col; col < cols; col += group_warps * 32) {
            const int k = col / p.count;
            float v[8];
            unpack8(staged[col], v);
            const float* column = c.fn + 8LL * (k * groups + p.first + col - k * p.count);
#pragma unroll
            for (int r = 0; r < HYPER_ROW_CHUNK; ++r) {
                const int row = first + r * row_groups;
                if (row < c.rows) {
                    const float4* w = reinterpret_cast<const float4*>(column + row * width);
                    const float4 a = w[0], b = w[1];
                    acc[r] += a.x * v[0] + a.y * v[1] + a.z * v[2] + a.w * v[3] + b.x * v[4] + b.y * v[5] +
                              b.z * v[6] + b.w * v[7];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < HYPER_ROW_CHUNK; ++r) {
            const int row = first + r * row_groups;
            if (row < c.rows) {             // uniform over the warp: every lane shuffles
                const float s = warp_sum(acc[r]);
                if (lane == 0) partial[warp][row] = s;
            }
        }
    }
    const float s = warp_sum(sum_squares);
    if (lane == 0) partial[warp][c.rows] = s;
}

// The token's dot products (fn's rows . its row; then its sum of squares: dots[0 .. rows]) from every piece's, in
// the CTA that holds its last piece to finish: the other CTAs return false. Each piece's go through partials
// [T, slices, rows + 1] (float32); arrivals[t] counts the token's finished pieces, 0 before a launch and after (the
// last piece resets it). One piece: the CTA's own, nothing written.
__device__ bool gather_dots(float* dots, int rows, float* partials, unsigned* arrivals) {
    __shared__ bool last;
    const long long t = blockIdx.x;
    const int slices = gridDim.y;
    if (slices == 1) return true;
    float* token_partials = partials + t * slices * (rows + 1);
    if ((int)threadIdx.x <= rows) token_partials[blockIdx.y * (rows + 1) + threadIdx.x] = dots[threadIdx.x];
    __threadfence();                    // this piece's streams and dots before its arrival
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrivals + t, 1u) == (unsigned)slices - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    if ((int)threadIdx.x <= rows) {
        float s = 0.f;
        for (int i = 0; i < slices; ++i) s += __ldcg(token_partials + i * (rows + 1) + threadIdx.x);
        dots[threadIdx.x] = s;
    }
    if (threadIdx.x == 0) arrivals[t] = 0u;
    __syncthreads();
    return true;
}
