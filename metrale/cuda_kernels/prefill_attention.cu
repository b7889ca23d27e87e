// Paged prefill attention (flash-attention-2 over 64-row query tiles), reading K/V tiles through the block
// table; chunked prefill attends to earlier chunks too. Layouts and fragments: attention_tiles.cuh.
#include "attention_tiles.cuh"

namespace {

// grid (ceil(max_query_len / PREFILL_ROWS), num_heads, num_segments), THREADS threads. CTA (tile, head, s)
// attends query rows [tile * 64, tile * 64 + 64) of segment s (warp w: rows 16w .. 16w + 15) for one head,
// over keys from the window start of its first row to its last row's position. Tiles run last first, so
// the longest CTAs of a causal segment start earliest. Not causal (an encoder's self-attention, a decoder's
// cross-attention over its source's blocks): every row sees every key of the segment's context. FP8: the cache
// holds e4m3 values with kv_scales [2, num_kv_heads] (attention_tiles.cuh).
template <int HEAD_DIM, bool FP8 = false>
__device__ __forceinline__ void paged_prefill_attention(bf16* out, long long out_stride, const bf16* q,
                                                        long long q_stride, const bf16* kv_cache,
                                                        long long plane_elems, const int* query_starts,
                                                        const int* query_lens, const int* context_lens,
                                                        const int* block_tables, int max_blocks, int num_kv_heads,
                                                        int group_size, int block_shift, float scale_log2,
                                                        int sliding_window, int causal, const float* kv_scales) {
    using T = Tile<HEAD_DIM>;
    __shared__ __align__(16) unsigned char shared[T::KV_BYTES];
    bf16* k_tile = reinterpret_cast<bf16*>(shared);
    bf16* v_tile = k_tile + T::ELEMS;

    const int query_tile = gridDim.x - 1 - blockIdx.x, head = blockIdx.y, segment = blockIdx.z;
    const int query_len = query_lens[segment];
    const int row0 = query_tile * PREFILL_ROWS;
    if (row0 >= query_len) return;
    const int rows = min(PREFILL_ROWS, query_len - row0);
    // The last key the CTA's first and last rows see (not causal: the context's last, for every row).
    const int context = context_lens[segment];
    const int first_position = causal ? context - query_len + row0 : context - 1;
    const int last_position = causal ? first_position + rows - 1 : context - 1;
    const int lo = sliding_window > 0 ? max(0, first_position - sliding_window + 1) : 0;
    const int hi = last_position + 1;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long first_row = (long long)query_starts[segment] + row0;
    load_query_tile<HEAD_DIM, PREFILL_ROWS>(v_tile, q + first_row * q_stride + (long long)head * HEAD_DIM, q_stride,
                                            rows);
    copy_async_commit();
    const int kv_head = head / group_size;
    float value_scale = 1.f;
    if constexpr (FP8) {
        scale_log2 *= kv_scales[kv_head];
        value_scale = kv_scales[num_kv_heads + kv_head];
    }
    const int* block_table = block_tables + (long long)segment * max_blocks;

    // positions of this lane's rows; padding rows past the segment take the last row's
    int position[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        position[r] = causal ? min(first_position + 16 * warp + (lane >> 2) + 8 * r, last_position) : last_position;

    unsigned query[HEAD_DIM / 16][4];
    WarpAttention<HEAD_DIM> attention;
    attention.start();
    unsigned probs[KV_TILE / 16][4];
    for_each_kv_tile<HEAD_DIM, FP8>(
        k_tile, v_tile, kv_cache, plane_elems, kv_head, block_table, block_shift, num_kv_heads * HEAD_DIM, lo, hi,
        [&] {
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) load_query_fragment<HEAD_DIM>(query[kk], v_tile, 16 * warp, kk);
        },
        [&](int tile, int phase) {
            if (phase == 0) {
                // a tile every key of which every row of the CTA may see needs no mask
                const bool inside = tile + KV_TILE - 1 <= first_position &&
                                    (sliding_window <= 0 || tile > last_position - sliding_window);
                attention.template add_scores<KV_TILE>(
                    probs,
                    [&](int kk, unsigned (&a)[4]) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) a[i] = query[kk][i];
                    },
                    k_tile, 0, scale_log2, !inside, [&](int r, int key) {
                        const int k = tile + key;
                        return k <= position[r] && (sliding_window <= 0 || k > position[r] - sliding_window);
                    });
            } else {
                attention.template add_values<KV_TILE>(probs, v_tile, 0);
            }
        });
    attention.finish();

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * warp + g + 8 * r;
        if (row >= rows) continue;
        const float inverse = value_scale / attention.row_sum[r];   // >= 1 key: the row's own position
        unsigned* destination = reinterpret_cast<unsigned*>(out + (first_row + row) * out_stride +
                                                            (long long)head * HEAD_DIM + 2 * t);
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            destination[4 * n] = float2_to_bf16x2(attention.acc[n][2 * r] * inverse,
                                                  attention.acc[n][2 * r + 1] * inverse);
    }
}

}  // namespace

// paged_prefill_attention_hdD reads a bf16 cache (kv_scales unread), paged_prefill_attention_fp8_hdD an FP8 one.
#define PREFILL_KERNEL(NAME, HEAD_DIM, FP8)                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME##_hd##HEAD_DIM(                                   \
        bf16* out, long long out_stride, const bf16* q, long long q_stride, const bf16* kv_cache,                   \
        long long plane_elems, const int* query_starts, const int* query_lens, const int* context_lens,            \
        const int* block_tables, int max_blocks, int num_kv_heads, int group_size, int block_shift,               \
        float scale_log2, int sliding_window, int causal, const float* kv_scales) {                                 \
        wait_for_previous_kernel();                                                                                  \
        paged_prefill_attention<HEAD_DIM, FP8>(out, out_stride, q, q_stride, kv_cache, plane_elems, query_starts,   \
                                               query_lens, context_lens, block_tables, max_blocks, num_kv_heads,    \
                                               group_size, block_shift, scale_log2, sliding_window, causal,         \
                                               kv_scales);                                                          \
    }

PREFILL_KERNEL(paged_prefill_attention, 32, false)
PREFILL_KERNEL(paged_prefill_attention, 64, false)
PREFILL_KERNEL(paged_prefill_attention, 128, false)
PREFILL_KERNEL(paged_prefill_attention_fp8, 32, true)
PREFILL_KERNEL(paged_prefill_attention_fp8, 64, true)
PREFILL_KERNEL(paged_prefill_attention_fp8, 128, true)

// Multi-head latent attention's prefill, up-projected (DeepSeek-V2/V3: key 128 + 64 rotary, value 128): each head
// attends over keys of NOPE + ROPE and values of V, over one piece of each segment's context whose latents were
// gathered and up-projected into workspace rows.
//
// Query row t of head h: NOPE values from q_nope + t * q_stride + h * q_head_stride (its part without position),
// then ROPE from q_rope + t * rope_q_stride + h * rope_q_head_stride (its rotated rotary part). Key k of segment
// s, key_lo[s] <= k < key_hi[s], is workspace row row_starts[s] + k - key_lo[s] of k_nope [rows, heads * NOPE] (head
// h's columns from h * NOPE), of rope_keys (row stride rope_stride: the rotated rotary key every head shares) and of
// values [rows, heads * V]. A context in several pieces merges through acc [T, heads, V] (the rows' normalised
// outputs so far, fp32) and lse [T, heads] (their log2-sum-exp): the first piece writes them, later ones merge,
// and the last writes out [T, heads * V] bf16 (a single piece writes out alone).
struct LatentPrefillArgs {
    bf16* out;
    long long out_stride;
    float* acc;
    float* lse;
    const bf16* q_nope;
    long long q_stride;
    int q_head_stride;
    const bf16* q_rope;
    long long rope_q_stride;
    int rope_q_head_stride;
    const bf16* k_nope;
    const bf16* values;
    const bf16* rope_keys;
    int rope_stride;
    const int* query_starts;
    const int* query_lens;
    const int* context_lens;
    const int* key_lo;
    const int* key_hi;
    const int* row_starts;
    int heads;
    float scale_log2;
    int first, last;
};

template <int NOPE, int ROPE, int V>
struct LatentPrefill {
    static constexpr int QK = NOPE + ROPE;
    static constexpr int K_ELEMS = KV_TILE * Tile<QK>::STRIDE;      // the K tile; then the Q tile, later V's
    static constexpr int SHARED_BYTES = 2 * (K_ELEMS + KV_TILE * (Tile<QK>::STRIDE > Tile<V>::STRIDE
                                                                      ? Tile<QK>::STRIDE : Tile<V>::STRIDE));
    static_assert(NOPE % 8 == 0 && QK % 16 == 0 && V % 16 == 0, "NOPE a multiple of 8, NOPE + ROPE and V of 16");
};

// grid (ceil(max_query_len / 64), heads, segments), THREADS threads, LatentPrefill::SHARED_BYTES of dynamic shared
// memory: paged_prefill_attention's CTA (64 query rows of one head) over the piece's keys.
template <int NOPE, int ROPE, int V>
__device__ __forceinline__ void latent_prefill_attention(const LatentPrefillArgs& a) {
    using L = LatentPrefill<NOPE, ROPE, V>;
    constexpr int QK = L::QK;
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* k_tile = reinterpret_cast<bf16*>(shared);
    bf16* v_tile = k_tile + L::K_ELEMS;         // the Q tile first

    const int query_tile = gridDim.x - 1 - blockIdx.x, head = blockIdx.y, segment = blockIdx.z;
    const int query_len = a.query_lens[segment];
    const int row0 = query_tile * PREFILL_ROWS;
    if (row0 >= query_len) return;
    const int rows = min(PREFILL_ROWS, query_len - row0);
    const int first_position = a.context_lens[segment] - query_len + row0;
    const int last_position = first_position + rows - 1;
    const int key_lo = a.key_lo[segment], lo = key_lo, hi = min(a.key_hi[segment], last_position + 1);
    const long long row_base = (long long)a.row_starts[segment] - key_lo;   // + key: its workspace row

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long first_row = (long long)a.query_starts[segment] + row0;
    {
        const bf16* q_nope = a.q_nope + first_row * a.q_stride + (long long)head * a.q_head_stride;
        const bf16* q_rope = a.q_rope + first_row * a.rope_q_stride + (long long)head * a.rope_q_head_stride;
        for (int chunk = threadIdx.x; chunk < PREFILL_ROWS * (QK / 8); chunk += THREADS) {
            const int r = chunk / (QK / 8), column = (chunk % (QK / 8)) * 8;
            const bf16* source = column < NOPE ? q_nope + r * a.q_stride + column
                                               : q_rope + r * a.rope_q_stride + column - NOPE;
            copy_async_16(v_tile + r * Tile<QK>::STRIDE + column, r < rows ? source : q_nope, r < rows);
        }
    }
    copy_async_commit();
    int position[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) position[r] = min(first_position + 16 * warp + (lane >> 2) + 8 * r, last_position);

    const long long nope_stride = (long long)a.heads * NOPE, v_stride = (long long)a.heads * V;
    const bf16* k_nope = a.k_nope + (long long)head * NOPE;
    const bf16* values = a.values + (long long)head * V;
    unsigned query[QK / 16][4];
    WarpAttention<QK, V> attention;
    attention.start();
    unsigned probs[KV_TILE / 16][4];
    for_each_tile(
        lo, hi,
        [&](int start) {    // columns < NOPE from the head's k_nope, the rest from the shared rotary key
#pragma unroll
            for (int i = 0; i < KV_TILE * (QK / 8) / THREADS; ++i) {
                const int chunk = threadIdx.x + i * THREADS;
                const int r = chunk / (QK / 8), column = (chunk % (QK / 8)) * 8, key = start + r;
                const bool valid = key >= lo && key < hi;
                const bf16* source = a.rope_keys;
                if (valid)
                    source = column < NOPE ? k_nope + (row_base + key) * nope_stride + column
                                           : a.rope_keys + (row_base + key) * a.rope_stride + column - NOPE;
                copy_async_16(k_tile + r * Tile<QK>::STRIDE + column, source, valid);
            }
        },
        [&](int start) {
#pragma unroll
            for (int i = 0; i < KV_TILE * (V / 8) / THREADS; ++i) {
                const int chunk = threadIdx.x + i * THREADS;
                const int r = chunk / (V / 8), column = (chunk % (V / 8)) * 8, key = start + r;
                const bool valid = key >= lo && key < hi;
                copy_async_16(v_tile + r * Tile<V>::STRIDE + column,
                              valid ? values + (row_base + key) * v_stride + column : values, valid);
            }
        },
        [&] {
#pragma unroll
            for (int kk = 0; kk < QK / 16; ++kk) load_query_fragment<QK>(query[kk], v_tile, 16 * warp, kk);
        },
        [&](int tile, int phase) {
            if (phase == 0) {
                const bool inside = tile >= lo && tile + KV_TILE <= hi && tile + KV_TILE - 1 <= first_position;
                attention.template add_scores<KV_TILE>(
                    probs,
                    [&](int kk, unsigned (&fragment)[4]) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) fragment[i] = query[kk][i];
                    },
                    k_tile, 0, a.scale_log2, !inside, [&](int r, int key) {
                        const int k = tile + key;
                        return k >= lo && k < hi && k <= position[r];
                    });
            } else {
                attention.template add_values<KV_TILE>(probs, v_tile, 0);
            }
        });
    attention.finish();

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * warp + g + 8 * r;
        if (row >= rows) continue;
        const long long token = first_row + row;
        const float sum = attention.row_sum[r];     // 0: the row saw no key of this piece
        const float piece_lse = sum > 0.f ? attention.row_max[r] + log2f(sum) : negative_infinity();
        float own = sum > 0.f ? 1.f / sum : 0.f, earlier = 0.f, merged_lse = piece_lse;
        float* acc_row = a.acc + (token * a.heads + head) * V;
        if (!a.first) {
            const float earlier_lse = a.lse[token * a.heads + head];
            merged_lse = fmaxf(earlier_lse, piece_lse);
            if (merged_lse != negative_infinity()) {
                const float total = exp2f(earlier_lse - merged_lse) + exp2f(piece_lse - merged_lse);
                merged_lse += log2f(total);
                earlier = exp2f(earlier_lse - merged_lse);
                own *= exp2f(piece_lse - merged_lse);
            }
        }
        __syncwarp();       // every lane of the quad has read the row's log-sum-exp before lane t = 0 writes it
#pragma unroll
        for (int n = 0; n < V / 8; ++n) {
            const int column = 8 * n + 2 * t;
            float x = attention.acc[n][2 * r] * own, y = attention.acc[n][2 * r + 1] * own;
            if (!a.first) {
                const float2 before = *reinterpret_cast<const float2*>(acc_row + column);
                x += before.x * earlier;
                y += before.y * earlier;
            }
            if (a.last)
                *reinterpret_cast<unsigned*>(a.out + token * a.out_stride + (long long)head * V + column) =
                    float2_to_bf16x2(x, y);
            else
                *reinterpret_cast<float2*>(acc_row + column) = make_float2(x, y);
        }
        if (!a.last && t == 0) a.lse[token * a.heads + head] = merged_lse;
    }
}

#define LATENT_PREFILL(NOPE, ROPE, V)                                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) latent_prefill_attention_n##NOPE##_r##ROPE##_v##V(      \
        bf16* out, long long out_stride, float* acc, float* lse, const bf16* q_nope, long long q_stride,           \
        int q_head_stride, const bf16* q_rope, long long rope_q_stride, int rope_q_head_stride, const bf16* k_nope, \
        const bf16* values, const bf16* rope_keys, int rope_stride, const int* query_starts, const int* query_lens, \
        const int* context_lens, const int* key_lo, const int* key_hi, const int* row_starts, int heads,           \
        float scale_log2, int first, int last) {                                                                    \
        wait_for_previous_kernel();                                                                                  \
        latent_prefill_attention<NOPE, ROPE, V>({out, out_stride, acc, lse, q_nope, q_stride, q_head_stride,        \
                                                 q_rope, rope_q_stride, rope_q_head_stride, k_nope, values,         \
                                                 rope_keys, rope_stride, query_starts, query_lens, context_lens,    \
                                                 key_lo, key_hi, row_starts, heads, scale_log2, first, last});      \
    }

LATENT_PREFILL(128, 64, 128)    // DeepSeek-V2, V2-Lite, V3, Kimi-K2
LATENT_PREFILL(64, 32, 64)      // MiniCPM3
LATENT_PREFILL(32, 16, 16)      // the tests' tiny models
