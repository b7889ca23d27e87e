// Paged decode attention (flash-decoding): one query per sequence; the query heads of a kv group share each
// K/V read; the context is split across CTAs (kernels/attention.py decode_partition) and the splits are
// merged by paged_decode_reduce (which the multi-head kernels of decode_attention_mha.cu use too). Layouts and
// fragments: attention_tiles.cuh.
#include "decode_attention.cuh"

namespace {

// grid (num_splits, num_kv_heads, B), THREADS threads. CTA (split, kv_head, b) attends the group_size
// (<= 16) query heads of kv_head, the 16 rows of one mma tile, over the keys of its split:
// [split * partition_size, (split + 1) * partition_size) within the window. Each warp takes 16 keys of
// every 64-key tile; the warps merge through shared memory at the end. A sequence whose keys lie in one
// split is written to out here; otherwise each split writes its normalized output and log2-sum-exp to
// partial_out [B, num_heads, num_splits, HEAD_DIM] and partial_lse [B, num_heads, num_splits] fp32.
// FP8: the cache holds e4m3 values with kv_scales [2, num_kv_heads] (attention_tiles.cuh).
template <int HEAD_DIM, bool FP8 = false>
__device__ __forceinline__ void paged_decode_attention(const DecodeArgs& a, const float* kv_scales = nullptr) {
    using T = Tile<HEAD_DIM>;
    __shared__ __align__(16) unsigned char shared[T::DECODE_BYTES];
    bf16* k_tile = reinterpret_cast<bf16*>(shared);
    bf16* v_tile = k_tile + T::ELEMS;
    bf16* query_tile = v_tile + T::ELEMS;

    const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const int num_splits = gridDim.x, num_kv_heads = gridDim.y;
    const DecodeKeys keys = decode_keys(a.context_lens[seq], a.sliding_window, split, a.partition_size);
    const int lo = keys.lo, hi = keys.hi;
    if (lo >= hi) return;
    const bool whole = keys.whole;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group_size = a.heads, head0 = kv_head * group_size;
    const long long row = a.seq_rows[seq];
    load_query_tile<HEAD_DIM, DECODE_ROWS>(query_tile, a.q + row * a.q_stride + (long long)head0 * HEAD_DIM,
                                           HEAD_DIM, group_size);
    copy_async_commit();
    float scale_log2 = a.scale_log2, value_scale = 1.f;
    if constexpr (FP8) {
        scale_log2 *= kv_scales[kv_head];
        value_scale = kv_scales[num_kv_heads + kv_head];
    }
    const int* block_table = a.block_tables + (long long)seq * a.max_blocks;

    WarpAttention<HEAD_DIM> attention;
    attention.start();
    unsigned probs[1][4];
    const int key0 = 16 * warp;   // this warp's keys in every tile
    for_each_kv_tile<HEAD_DIM, FP8>(
        k_tile, v_tile, a.kv_cache, a.plane_elems, kv_head, block_table, a.block_shift, num_kv_heads * HEAD_DIM, lo,
        hi, [] {},
        [&](int tile, int phase) {
            if (phase == 0) {
                // decode needs no causal mask: every key of the split in [lo, hi) is seen by the one query
                const bool edge = tile < lo || tile + KV_TILE > hi;
                attention.template add_scores<16>(
                    probs,
                    [&](int kk, unsigned (&fragment)[4]) {
                        load_query_fragment<HEAD_DIM>(fragment, query_tile, 0, kk);
                    },
                    k_tile, key0, scale_log2, edge,
                    [&](int, int key) { return tile + key >= lo && tile + key < hi; });
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
            a.out[row * a.out_stride + (long long)head * HEAD_DIM + d] = float_to_bf16(o / sum * value_scale);
        } else {
            const long long part = ((long long)seq * num_heads + head) * num_splits + split;
            a.partial_out[part * HEAD_DIM + d] = o / sum * value_scale;
            if (d == 0) a.partial_lse[part] = m + log2f(sum);
        }
    }
}

}  // namespace

DECODE_ENTRY(paged_decode_attention, THREADS, 32)
DECODE_ENTRY(paged_decode_attention, THREADS, 64)
DECODE_ENTRY(paged_decode_attention, THREADS, 128)

#define DECODE_FP8_ENTRY(HEAD_DIM)                                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_attention_fp8_hd##HEAD_DIM(                \
        DECODE_PARAMS, const float* kv_scales) {                                                                 \
        wait_for_previous_kernel();                                                                              \
        paged_decode_attention<HEAD_DIM, true>(DECODE_ARGS, kv_scales);                                          \
    }
DECODE_FP8_ENTRY(32)
DECODE_FP8_ENTRY(64)
DECODE_FP8_ENTRY(128)

// grid (num_heads, B), head_dim threads: the out row of each decode sequence whose keys span several
// splits = the mean of the splits' partial outputs weighted by 2^lse, and a head's sink (sinks [num_heads]
// natural-log logits, null: none) one more term of lse sink log2(e) and zero value. Splits are chosen as in
// paged_decode_attention; a sequence with one split was written there. A list of selected tokens
// (latent_attention.cu's _selected kernels) is split as a context of its length: its counts come as context_lens.
extern "C" __global__ void paged_decode_reduce(bf16* out, long long out_stride, const int* seq_rows,
                                               const int* context_lens, const float* partial_out,
                                               const float* partial_lse, const float* sinks, int sliding_window,
                                               int partition_size, int num_splits) {
    wait_for_previous_kernel();
    const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
    const int head_dim = blockDim.x, d = threadIdx.x;
    const int context = context_lens[seq];
    if (context <= 0) return;
    const int window_start = sliding_window > 0 ? max(0, context - sliding_window) : 0;
    const int first = window_start / partition_size, last = (context - 1) / partition_size;
    if (first == last) return;
    const long long base = ((long long)seq * num_heads + head) * num_splits;
    const float sink = sinks != nullptr ? sinks[head] * 1.4426950408889634f : negative_infinity();
    float m = sink;
    for (int s = first; s <= last; ++s) m = fmaxf(m, partial_lse[base + s]);
    float sum = fast_exp2(sink - m), o = 0.f;
    for (int s = first; s <= last; ++s) {
        const float weight = fast_exp2(partial_lse[base + s] - m);
        sum += weight;
        o += weight * partial_out[(base + s) * head_dim + d];
    }
    out[(long long)seq_rows[seq] * out_stride + (long long)head * head_dim + d] = float_to_bf16(o / sum);
}
