// Paged decode attention (flash-decoding): one query per sequence; the query heads of a kv group share each
// K/V read; the context is split across CTAs (kernels/attention.py decode_partition) and the splits are
// merged by paged_decode_reduce. Layouts and fragments: attention_tiles.cuh.
#include "attention_tiles.cuh"

namespace {

// The keys [lo, hi) split `split` of a decode sequence attends within its window; whole: one split holds them all
// (the sequence's row is written directly, paged_decode_reduce skips it).
struct DecodeKeys {
    int lo, hi;
    bool whole;
};

__device__ __forceinline__ DecodeKeys decode_keys(int context, int sliding_window, int split, int partition_size) {
    const int window_start = sliding_window > 0 ? max(0, context - sliding_window) : 0;
    return {max(window_start, split * partition_size), min(context, (split + 1) * partition_size),
            window_start / partition_size == (context - 1) / partition_size};
}

// grid (num_splits, num_kv_heads, B), THREADS threads. CTA (split, kv_head, b) attends the group_size
// (<= 16) query heads of kv_head, the 16 rows of one mma tile, over the keys of its split:
// [split * partition_size, (split + 1) * partition_size) within the window. Each warp takes 16 keys of
// every 64-key tile; the warps merge through shared memory at the end. A sequence whose keys lie in one
// split is written to out here; otherwise each split writes its normalized output and log2-sum-exp to
// partial_out [B, num_heads, num_splits, HEAD_DIM] and partial_lse [B, num_heads, num_splits] fp32.
template <int HEAD_DIM>
__device__ __forceinline__ void paged_decode_attention(bf16* out, long long out_stride, const bf16* q,
                                                       long long q_stride, const bf16* kv_cache,
                                                       long long plane_elems, const int* seq_rows,
                                                       const int* context_lens, const int* block_tables,
                                                       int max_blocks, float* partial_out, float* partial_lse,
                                                       int group_size, int block_shift, float scale_log2,
                                                       int sliding_window, int partition_size) {
    using T = Tile<HEAD_DIM>;
    __shared__ __align__(16) unsigned char shared[T::DECODE_BYTES];
    bf16* k_tile = reinterpret_cast<bf16*>(shared);
    bf16* v_tile = k_tile + T::ELEMS;
    bf16* query_tile = v_tile + T::ELEMS;

    const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const int num_splits = gridDim.x, num_kv_heads = gridDim.y;
    const DecodeKeys keys = decode_keys(context_lens[seq], sliding_window, split, partition_size);
    const int lo = keys.lo, hi = keys.hi;
    if (lo >= hi) return;
    const bool whole = keys.whole;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head0 = kv_head * group_size;
    const long long row = seq_rows[seq];
    load_query_tile<HEAD_DIM, DECODE_ROWS>(query_tile, q + row * q_stride + (long long)head0 * HEAD_DIM, HEAD_DIM,
                                           group_size);
    copy_async_commit();
    const bf16* k_plane = kv_cache + kv_head * HEAD_DIM;
    const int* block_table = block_tables + (long long)seq * max_blocks;

    WarpAttention<HEAD_DIM> attention;
    attention.start();
    unsigned probs[1][4];
    const int key0 = 16 * warp;   // this warp's keys in every tile
    for_each_kv_tile<HEAD_DIM>(
        k_tile, v_tile, k_plane, k_plane + plane_elems, block_table, block_shift, num_kv_heads * HEAD_DIM, lo, hi,
        [] {},
        [&](int tile, int phase) {
            if (phase == 0) {
                // decode needs no causal mask: every key of the split in [lo, hi) is seen by the one query
                const bool edge = tile < lo || tile + KV_TILE > hi;
                attention.template add_scores<16>(
                    probs, [&](int kk, unsigned (&a)[4]) { load_query_fragment<HEAD_DIM>(a, query_tile, 0, kk); },
                    k_tile, key0, scale_log2, edge, [&](int, int key) { return tile + key >= lo && tile + key < hi; });
            } else {
                attention.template add_values<16>(probs, v_tile, key0);
            }
        });
    attention.finish();

    // Merge the warps over the tiles' bytes: [warp][row][dim] accumulators, [warp][row] max and sum.
    float* merge_acc = reinterpret_cast<float*>(shared);
    float* merge_max = merge_acc + WARPS * DECODE_ROWS * HEAD_DIM;
    float* merge_sum = merge_max + WARPS * DECODE_ROWS;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int slot = warp * DECODE_ROWS + g + 8 * r;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            *reinterpret_cast<float2*>(merge_acc + slot * HEAD_DIM + 8 * n + 2 * t) =
                make_float2(attention.acc[n][2 * r], attention.acc[n][2 * r + 1]);
        if (t == 0) {
            merge_max[slot] = attention.row_max[r];
            merge_sum[slot] = attention.row_sum[r];
        }
    }
    __syncthreads();
    const int num_heads = num_kv_heads * group_size;
    for (int i = threadIdx.x; i < group_size * HEAD_DIM; i += THREADS) {
        const int head_row = i / HEAD_DIM, d = i % HEAD_DIM;
        // every row saw at least one key in some warp (lo < hi, and padded query rows are zero, not masked)
        float m = negative_infinity();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, merge_max[w * DECODE_ROWS + head_row]);
        float sum = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int slot = w * DECODE_ROWS + head_row;
            const float weight = fast_exp2(merge_max[slot] - m);
            sum += weight * merge_sum[slot];
            o += weight * merge_acc[slot * HEAD_DIM + d];
        }
        const int head = head0 + head_row;
        if (whole) {
            out[row * out_stride + (long long)head * HEAD_DIM + d] = float_to_bf16(o / sum);
        } else {
            const long long part = ((long long)seq * num_heads + head) * num_splits + split;
            partial_out[part * HEAD_DIM + d] = o / sum;
            if (d == 0) partial_lse[part] = m + log2f(sum);
        }
    }
}

// Multi-head attention (one query head per kv head): a warp per head, on CUDA cores. An mma tile would fill one of
// its 16 rows. grid (num_splits, ceil(num_heads / MHA_WARPS), B), MHA_WARPS warps. The split's keys go 32 at a
// time: lane l scores key base + l against the query (in shared memory, fp32, times scale_log2), the warp keeps
// the running max and sum (online softmax), then adds each key's value row (lane l holds dims l * DIMS ..) weighted
// by its probability. Output, partials and the merge of splits exactly as paged_decode_attention's.
constexpr int MHA_WARPS = 4;

template <int HEAD_DIM>
__device__ __forceinline__ void paged_decode_attention_mha(bf16* out, long long out_stride, const bf16* q,
                                                           long long q_stride, const bf16* kv_cache,
                                                           long long plane_elems, const int* seq_rows,
                                                           const int* context_lens, const int* block_tables,
                                                           int max_blocks, float* partial_out, float* partial_lse,
                                                           int num_heads, int block_shift, float scale_log2,
                                                           int sliding_window, int partition_size) {
    constexpr int DIMS = HEAD_DIM / 32;     // output dims per lane
    __shared__ __align__(16) float query[MHA_WARPS][HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y * MHA_WARPS + warp, split = blockIdx.x, seq = blockIdx.z;
    if (head >= num_heads) return;
    const int num_splits = gridDim.x;
    const DecodeKeys keys = decode_keys(context_lens[seq], sliding_window, split, partition_size);
    const int lo = keys.lo, hi = keys.hi;
    if (lo >= hi) return;
    const bool whole = keys.whole;

    const long long row = seq_rows[seq];
    const bf16* query_row = q + row * q_stride + (long long)head * HEAD_DIM;
    for (int d = lane; d < HEAD_DIM; d += 32) query[warp][d] = bf16_to_float(query_row[d]) * scale_log2;
    __syncwarp();
    const long long slot_elems = (long long)num_heads * HEAD_DIM;     // one token's K (or V) of every head
    const bf16* k_plane = kv_cache + (long long)head * HEAD_DIM;
    const bf16* v_plane = k_plane + plane_elems;
    const int* block_table = block_tables + (long long)seq * max_blocks;
    const int block_mask = (1 << block_shift) - 1;

    float running_max = negative_infinity(), sum = 0.f, acc[DIMS];
#pragma unroll
    for (int i = 0; i < DIMS; ++i) acc[i] = 0.f;
    for (int base = lo; base < hi; base += 32) {
        const int key = base + lane;
        float score = negative_infinity();
        long long slot = 0;
        if (key < hi) {
            slot = ((long long)block_table[key >> block_shift] << block_shift) + (key & block_mask);
            const uint4* k = reinterpret_cast<const uint4*>(k_plane + slot * slot_elems);
            const float4* qv = reinterpret_cast<const float4*>(query[warp]);
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 8; ++c) {
                const uint4 u = k[c];
                const float4 q0 = qv[2 * c], q1 = qv[2 * c + 1];
                const float2 a = bf16x2_to_float2(u.x), b = bf16x2_to_float2(u.y);
                const float2 e = bf16x2_to_float2(u.z), f = bf16x2_to_float2(u.w);
                dot += q0.x * a.x + q0.y * a.y + q0.z * b.x + q0.w * b.y + q1.x * e.x + q1.y * e.y + q1.z * f.x +
                       q1.w * f.y;
            }
            score = dot;
        }
        const float new_max = fmaxf(running_max, warp_max(score));    // finite: key lo < hi is in the first chunk
        const float rescale = fast_exp2(running_max - new_max);
        const float p = fast_exp2(score - new_max);                    // 0 past hi
        sum = sum * rescale + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DIMS; ++i) acc[i] *= rescale;
        running_max = new_max;
        const int keys = min(32, hi - base);
#pragma unroll 4
        for (int j = 0; j < keys; ++j) {
            const float weight = __shfl_sync(0xffffffffu, p, j);
            const long long slot_j = __shfl_sync(0xffffffffu, slot, j);
            const bf16* v = v_plane + slot_j * slot_elems + lane * DIMS;
            if constexpr (DIMS == 1) {
                acc[0] += weight * bf16_to_float(v[0]);
            } else if constexpr (DIMS == 2) {
                const float2 x = bf16x2_to_float2(*reinterpret_cast<const unsigned*>(v));
                acc[0] += weight * x.x;
                acc[1] += weight * x.y;
            } else {
                const uint2 u = *reinterpret_cast<const uint2*>(v);
                const float2 x = bf16x2_to_float2(u.x), y = bf16x2_to_float2(u.y);
                acc[0] += weight * x.x;
                acc[1] += weight * x.y;
                acc[2] += weight * y.x;
                acc[3] += weight * y.y;
            }
        }
    }
    const int d0 = lane * DIMS;
    if (whole) {
        bf16* o = out + row * out_stride + (long long)head * HEAD_DIM + d0;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) o[i] = float_to_bf16(acc[i] / sum);
    } else {
        const long long part = ((long long)seq * num_heads + head) * num_splits + split;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) partial_out[part * HEAD_DIM + d0 + i] = acc[i] / sum;
        if (lane == 0) partial_lse[part] = running_max + log2f(sum);
    }
}

}  // namespace

// The extern "C" entry points: NAME##_hd##HEAD_DIM runs NAME<HEAD_DIM> in BLOCK threads. heads: the grouped kernel's
// group size, the multi-head kernel's num_heads.
#define DECODE_ENTRY(NAME, BLOCK, HEAD_DIM)                                                                  \
    extern "C" __global__ void __launch_bounds__(BLOCK) NAME##_hd##HEAD_DIM(                                     \
        bf16* out, long long out_stride, const bf16* q, long long q_stride, const bf16* kv_cache,                   \
        long long plane_elems, const int* seq_rows, const int* context_lens, const int* block_tables,               \
        int max_blocks, float* partial_out, float* partial_lse, int heads, int block_shift, float scale_log2,       \
        int sliding_window, int partition_size) {                                                                   \
        wait_for_previous_kernel();                                                                                  \
        NAME<HEAD_DIM>(out, out_stride, q, q_stride, kv_cache, plane_elems, seq_rows, context_lens, block_tables,   \
                       max_blocks, partial_out, partial_lse, heads, block_shift, scale_log2, sliding_window,       \
                       partition_size);                                                                              \
    }

DECODE_ENTRY(paged_decode_attention, THREADS, 32)
DECODE_ENTRY(paged_decode_attention, THREADS, 64)
DECODE_ENTRY(paged_decode_attention, THREADS, 128)
DECODE_ENTRY(paged_decode_attention_mha, MHA_WARPS * 32, 32)
DECODE_ENTRY(paged_decode_attention_mha, MHA_WARPS * 32, 64)
DECODE_ENTRY(paged_decode_attention_mha, MHA_WARPS * 32, 128)

// grid (num_heads, B), head_dim threads: the out row of each decode sequence whose keys span several
// splits = the mean of the splits' partial outputs weighted by 2^lse. Splits are chosen as in
// paged_decode_attention; a sequence with one split was written there.
extern "C" __global__ void paged_decode_reduce(bf16* out, long long out_stride, const int* seq_rows,
                                               const int* context_lens, const float* partial_out,
                                               const float* partial_lse, int sliding_window, int partition_size,
                                               int num_splits) {
    wait_for_previous_kernel();
    const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
    const int head_dim = blockDim.x, d = threadIdx.x;
    const int context = context_lens[seq];
    if (context <= 0) return;
    const int window_start = sliding_window > 0 ? max(0, context - sliding_window) : 0;
    const int first = window_start / partition_size, last = (context - 1) / partition_size;
    if (first == last) return;
    const long long base = ((long long)seq * num_heads + head) * num_splits;
    float m = negative_infinity();
    for (int s = first; s <= last; ++s) m = fmaxf(m, partial_lse[base + s]);
    float sum = 0.f, o = 0.f;
    for (int s = first; s <= last; ++s) {
        const float weight = fast_exp2(partial_lse[base + s] - m);
        sum += weight;
        o += weight * partial_out[(base + s) * head_dim + d];
    }
    out[(long long)seq_rows[seq] * out_stride + (long long)head * head_dim + d] = float_to_bf16(o / sum);
}
