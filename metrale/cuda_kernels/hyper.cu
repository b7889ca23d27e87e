// Manifold-constrained hyper-connections (mHC: DeepSeek-V4, Hy4), as cpu/hyper.py computes them: a token's hc_mult
// residual streams (bf16 [T, hc_mult * hidden], stream n in columns n * hidden .. (n + 1) * hidden) collapsed into a
// block's input, widened again by its output, mixed between blocks by comb. Weights fp32, math fp32, each bf16
// result rounded once.
#include "hyper_pieces.cuh"

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// The RMSNorm the block's input goes through (as norm.cu's rms_norm of it): weight [hidden] bf16, or null (none).
struct OutputNorm {
    const bf16* weight;
    float eps;
};

// m [n, n] (shared, row-major) divided by each row's (by_row) or column's sum + eps, by one warp: lane entries lane
// and lane + 32 (n <= 8).
__device__ __forceinline__ void normalise(float* m, int n, float eps, bool by_row) {
    const int lane = threadIdx.x & 31;
    float v[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int e = lane + 32 * s, j = e / n, k = e % n;
        if (e < n * n) {
            float sum = 0.f;
            for (int i = 0; i < n; ++i) sum += by_row ? m[j * n + i] : m[i * n + k];
            v[s] = m[e] / (sum + eps);
        }
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        if (lane + 32 * s < n * n) m[lane + 32 * s] = v[s];
    }
    __syncwarp();
}

// DeepSeek-V4's comb, by one warp: softmax over each row of the n x n logits (+ eps), a column normalisation, then
// sinkhorn_iters - 1 (row, column) normalisations. dots: the comb rows' dot products; comb_row [n * n] global.
__device__ void sinkhorn_comb(const float* dots, float inv_rms, const Connection& c, float* comb_row) {
    __shared__ float m[HYPER_MAX_STREAMS * HYPER_MAX_STREAMS];
    const int lane = threadIdx.x & 31, n = c.hc_mult, base = 2 * n;
    for (int e = lane; e < n * n; e += 32) m[e] = dots[e] * inv_rms * c.scale[2] + c.base[base + e];
    __syncwarp();
    float v[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int e = lane + 32 * s, row = e / n * n;
        if (e < n * n) {
            float top = m[row];
            for (int i = 1; i < n; ++i) top = fmaxf(top, m[row + i]);
            float sum = 0.f;
            for (int i = 0; i < n; ++i) sum += expf(m[row + i] - top);
            v[s] = expf(m[e] - top) / sum + c.eps;
        }
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        if (lane + 32 * s < n * n) m[lane + 32 * s] = v[s];
    }
    __syncwarp();
    normalise(m, n, c.eps, false);
    for (int i = 1; i < c.sinkhorn_iters; ++i) {
        normalise(m, n, c.eps, true);
        normalise(m, n, c.eps, false);
    }
    for (int e = lane; e < n * n; e += 32) comb_row[e] = m[e];
}

// One unit of a token's streams: from shared memory, or (another CTA's piece) from global memory past L1, which
// another CTA's stores do not reach.
__device__ __forceinline__ uint4 row_unit(const uint4* units, int i, bool global) {
    return global ? __ldcg(units + i) : units[i];
}

// The block's input and mix from the CTA's piece of a token's streams, staged in shared memory (written by the CTA
// before the call, which syncs first); sum_squares: this thread's share of the piece's squares. The CTA that
// finishes the token's last piece (gather_dots) goes on to x_row [hidden] bf16 (through norm where its weight is
// given), post_row [hc_mult] (null: the head) and comb_row [hc_mult^2] (null: none), fp32, reading the other pieces
// from row (the token's streams).
__device__ void collapse_piece(const uint4* staged, const uint4* row, float sum_squares, const Connection& c,
                               int groups, Piece p, float* partials, unsigned* arrivals, OutputNorm norm,
                               uint4* x_row, float* post_row, float* comb_row) {
    __shared__ float partial[HYPER_WARPS][HYPER_MAX_ROWS + 1];
    __shared__ float dots[HYPER_MAX_ROWS + 1];         // fn's rows . the row; then the sum of squares
    const int n = c.hc_mult;
    __syncthreads();
    project(staged, groups, p, c, sum_squares, partial);
    __syncthreads();
    if ((int)threadIdx.x <= c.rows) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < HYPER_WARPS; ++w) s += partial[w][threadIdx.x];
        dots[threadIdx.x] = s;
    }
    __syncthreads();
    if (!gather_dots(dots, c.rows, partials, arrivals)) return;
    const float inv_rms = rsqrtf(dots[c.rows] / (float)(8 * n * groups) + c.norm_eps);
    // pre, in every thread's registers: n sigmoids cost less than a barrier
    float pre[HYPER_MAX_STREAMS];
#pragma unroll
    for (int k = 0; k < HYPER_MAX_STREAMS; ++k)
        pre[k] = k < n ? sigmoid(dots[k] * inv_rms * c.scale[0] + c.base[k]) + c.eps : 0.f;
    const bool whole = p.count == groups;               // the piece is the row: staged[k * groups + g]
    const uint4* units = whole ? staged : row;
    float x_squares = 0.f;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < HYPER_MAX_STREAMS; ++k) {
            if (k < n) {
                float v[8];
                unpack8(row_unit(units, k * groups + g, !whole), v);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] += pre[k] * v[i];
            }
        }
        const uint4 x = pack8(acc);
        x_row[g] = x;
        x_squares += unit_squares(x);
    }
    if (norm.weight) {      // each thread scales the units it wrote, so it reads back only its own stores
        const float inv_rms = rsqrtf(block_sum(x_squares) / (float)(8 * groups) + norm.eps);
        const uint4* weight = reinterpret_cast<const uint4*>(norm.weight);
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            const uint4 v = x_row[g], w = weight[g];
            x_row[g] = make_uint4(scale_pair(v.x, w.x, inv_rms), scale_pair(v.y, w.y, inv_rms),
                                  scale_pair(v.z, w.z, inv_rms), scale_pair(v.w, w.w, inv_rms));
        }
    }
    const int k = threadIdx.x;
    if (post_row && k < n)
        post_row[k] = c.post_magnitude * sigmoid(dots[n + k] * inv_rms * c.scale[1] + c.base[n + k]) + c.post_eps;
    if (comb_row && (threadIdx.x >> 5) == HYPER_WARPS - 1) sinkhorn_comb(dots + 2 * n, inv_rms, c, comb_row);
}

// Unit g of every new stream k = post[k] * out + (sum over j of comb[j * n + k] * stream j, or stream k where comb
// is null), fp32, rounded to bf16, into new_row (may be streams_row: each unit is read before it is written) and
// staged[k * staged_stride] where staged is not null. Returns the sum of squares of the rounded values.
__device__ __forceinline__ float expand_unit(int g, int n, int groups, const uint4* out_row, const uint4* streams_row,
                                             uint4* new_row, uint4* staged, int staged_stride, const float* post,
                                             const float* comb) {
    uint4 old[HYPER_MAX_STREAMS];
#pragma unroll
    for (int j = 0; j < HYPER_MAX_STREAMS; ++j) {
        if (j < n) old[j] = streams_row[j * groups + g];
    }
    float out[8];
    unpack8(out_row[g], out);
    float sum_squares = 0.f;
#pragma unroll
    for (int k = 0; k < HYPER_MAX_STREAMS; ++k) {
        if (k >= n) break;
        float mixed[8];
        if (comb) {
#pragma unroll
            for (int i = 0; i < 8; ++i) mixed[i] = 0.f;
#pragma unroll
            for (int j = 0; j < HYPER_MAX_STREAMS; ++j) {
                if (j < n) {
                    float v[8];
                    unpack8(old[j], v);
                    const float w = comb[j * n + k];
#pragma unroll
                    for (int i = 0; i < 8; ++i) mixed[i] += w * v[i];
                }
            }
        } else {
            unpack8(old[k], mixed);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) mixed[i] = post[k] * out[i] + mixed[i];
        const uint4 rounded = pack8(mixed);
        new_row[k * groups + g] = rounded;
        if (staged) staged[k * staged_stride] = rounded;
        sum_squares += unit_squares(rounded);
    }
    return sum_squares;
}

// streams [T, hc_mult * hidden] = x [T, hidden] in each stream, bf16; row strides in 16-byte units. A flat grid
// over the T * groups units of x (groups = hidden / 8), one per thread.
extern "C" __global__ void hyper_widen(uint4* streams, long long streams_stride, const uint4* x, long long x_stride,
                                       int num_tokens, int hc_mult, int groups) {
    wait_for_previous_kernel();
    const long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (long long)num_tokens * groups) return;
    const long long t = unit / groups;
    const int g = (int)(unit - t * groups);
    const uint4 v = x[t * x_stride + g];
    for (int k = 0; k < hc_mult; ++k) streams[t * streams_stride + (long long)k * groups + g] = v;
}

// x [T, hidden] bf16 = sum over n of pre[n] * stream n (then RMSNorm'd by norm_weight [hidden] bf16 and
// out_norm_eps, where norm_weight is not null); post [T, hc_mult] and, where sinkhorn_iters > 0, comb [T,
// hc_mult^2] (row-major [j][k]) fp32, contiguous. Grid (T, slices): CTA (t, s) of HYPER_THREADS holds units s * span
// .. (s + 1) * span - 1 of each of token t's streams (one slice: the whole row); partials [T, slices, rows + 1]
// float32 and arrivals [T] (0) where slices > 1 (gather_dots). Dynamic shared memory: the piece as bf16 (hc_mult *
// span * 16 bytes; 56 KB for a whole row at 4 x 7168): exact, as the streams are bf16, and half of fp32's, so twice
// the CTAs fit an SM; the projection reads it once per HYPER_ROW_CHUNK rows, the weighted sum once more. Row strides
// in elements, multiples of 8; hidden % 8 == 0; rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(HYPER_THREADS)
hyper_collapse(bf16* x, long long x_stride, float* post, float* comb, const bf16* streams, long long streams_stride,
               const float* fn, const float* base, const float* scale, int hc_mult, int hidden, float norm_eps,
               float eps, float post_magnitude, float post_eps, int sinkhorn_iters, const bf16* norm_weight,
               float out_norm_eps, float* partials, unsigned* arrivals, int span) {
    wait_for_previous_kernel();
    extern __shared__ uint4 staged[];
    const long long t = blockIdx.x;
    const int n = hc_mult, groups = hidden >> 3, with_comb = sinkhorn_iters > 0;
    const Connection c = {fn, base, scale, n, 2 * n + (with_comb ? n * n : 0), sinkhorn_iters, norm_eps, eps,
                          post_magnitude, post_eps};
    const Piece p = piece_of(groups, span);
    const uint4* row = reinterpret_cast<const uint4*>(streams + t * streams_stride);
    const float sum_squares = stage_piece(staged, row, n, groups, p);
    collapse_piece(staged, row, sum_squares, c, groups, p, partials, arrivals, {norm_weight, out_norm_eps},
                   reinterpret_cast<uint4*>(x + t * x_stride), post + t * n, with_comb ? comb + t * n * n : nullptr);
}

// The streams after the last block, collapsed by HyperHead: x = sum over n of (sigmoid(logit * scale[0] + base) +
// eps) * stream n. fn [hc_mult, hc_mult * hidden], base [hc_mult], scale [1]; grid, pieces and layout as
// hyper_collapse.
extern "C" __global__ void __launch_bounds__(HYPER_THREADS)
hyper_head(bf16* x, long long x_stride, const bf16* streams, long long streams_stride, const float* fn,
           const float* base, const float* scale, int hc_mult, int hidden, float norm_eps, float eps,
           const bf16* norm_weight, float out_norm_eps, float* partials, unsigned* arrivals, int span) {
    wait_for_previous_kernel();
    extern __shared__ uint4 staged[];
    const long long t = blockIdx.x;
    const int groups = hidden >> 3;
    const Connection c = {fn, base, scale, hc_mult, hc_mult, 0, norm_eps, eps, 0.f, 0.f};
    const Piece p = piece_of(groups, span);
    const uint4* row = reinterpret_cast<const uint4*>(streams + t * streams_stride);
    const float sum_squares = stage_piece(staged, row, hc_mult, groups, p);
    collapse_piece(staged, row, sum_squares, c, groups, p, partials, arrivals, {norm_weight, out_norm_eps},
                   reinterpret_cast<uint4*>(x + t * x_stride), nullptr, nullptr);
}

// new_streams [T, hc_mult * hidden] = the streams after a block: hyper_expand's unit of out [T, hidden] and streams,
// by post [T, hc_mult] and comb [T, hc_mult^2] (null: none), fp32 contiguous. new_streams may be streams. A flat grid
// over the T * groups units (groups = hidden / 8), one per thread; row strides in 16-byte units.
extern "C" __global__ void hyper_expand(uint4* new_streams, long long new_stride, const uint4* out,
                                        long long out_stride, const uint4* streams, long long streams_stride,
                                        const float* post, const float* comb, int num_tokens, int hc_mult,
                                        int groups) {
    wait_for_previous_kernel();
    const long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (long long)num_tokens * groups) return;
    const long long t = unit / groups;
    const int g = (int)(unit - t * groups), n = hc_mult;
    expand_unit(g, n, groups, out + t * out_stride, streams + t * streams_stride, new_streams + t * new_stride,
                nullptr, 0, post + t * n, comb ? comb + t * n * n : nullptr);
}

// A block boundary in one pass: the streams expanded by the block's output out [T, hidden] and its mix (post, comb),
// then the next block's collapse of the new streams as bf16 holds them (transformers casts the streams to bf16
// between blocks): x its input. In place: streams, post [T, hc_mult] and comb [T, hc_mult^2] (given where
// sinkhorn_iters > 0, the previous connection's and the next's alike) become the next ones; each CTA reads its
// token's mix into shared memory before its first barrier (and before its piece's arrival), the mix's next value is
// written after the token's last piece (each CTA expands its own units of every stream: the pieces never touch
// another's). Grid, pieces and layout as hyper_collapse.
extern "C" __global__ void __launch_bounds__(HYPER_THREADS)
hyper_boundary(bf16* streams, long long streams_stride, bf16* x, long long x_stride, const bf16* out,
               long long out_stride, float* post, float* comb, const float* fn, const float* base, const float* scale,
               int hc_mult, int hidden, float norm_eps, float eps, float post_magnitude, float post_eps,
               int sinkhorn_iters, const bf16* norm_weight, float out_norm_eps, float* partials, unsigned* arrivals,
               int span) {
    wait_for_previous_kernel();
    extern __shared__ uint4 staged[];
    __shared__ float mix[HYPER_MAX_STREAMS + HYPER_MAX_STREAMS * HYPER_MAX_STREAMS];   // post, then comb
    const long long t = blockIdx.x;
    const int n = hc_mult, groups = hidden >> 3, with_comb = sinkhorn_iters > 0;
    const Connection c = {fn, base, scale, n, 2 * n + (with_comb ? n * n : 0), sinkhorn_iters, norm_eps, eps,
                          post_magnitude, post_eps};
    const Piece p = piece_of(groups, span);
    float* post_row = post + t * n;
    float* comb_row = with_comb ? comb + t * n * n : nullptr;
    if ((int)threadIdx.x < n) mix[threadIdx.x] = post_row[threadIdx.x];
    if (comb_row && (int)threadIdx.x < n * n) mix[n + threadIdx.x] = comb_row[threadIdx.x];
    __syncthreads();
    uint4* row = reinterpret_cast<uint4*>(streams + t * streams_stride);
    const uint4* out_row = reinterpret_cast<const uint4*>(out + t * out_stride);
    float sum_squares = 0.f;
    for (int j = threadIdx.x; j < p.count; j += blockDim.x)
        sum_squares += expand_unit(p.first + j, n, groups, out_row, row, row, staged + j, p.count, mix,
                                   comb_row ? mix + n : nullptr);
    collapse_piece(staged, row, sum_squares, c, groups, p, partials, arrivals, {norm_weight, out_norm_eps},
                   reinterpret_cast<uint4*>(x + t * x_stride), post_row, comb_row);
}
