// Paged prefill attention (flash-attention-2 over 64-row query tiles), reading K/V tiles through the block
// table; chunked prefill attends to earlier chunks too. Layouts and fragments: attention_tiles.cuh.
#include "attention_tiles.cuh"

namespace {

// grid (ceil(max_query_len / PREFILL_ROWS), num_heads, num_segments), THREADS threads. CTA (tile, head, s)
// attends query rows [tile * 64, tile * 64 + 64) of segment s (warp w: rows 16w .. 16w + 15) for one head,
// over keys from the window start of its first row to its last row's position. Tiles run last first, so
// the longest CTAs of a causal segment start earliest. Not causal (an encoder's self-attention, a decoder's
// cross-attention over its source's blocks): every row sees every key of the segment's context.
template <int HEAD_DIM>
__device__ __forceinline__ void paged_prefill_attention(bf16* out, long long out_stride, const bf16* q,
                                                        long long q_stride, const bf16* kv_cache,
                                                        long long plane_elems, const int* query_starts,
                                                        const int* query_lens, const int* context_lens,
                                                        const int* block_tables, int max_blocks, int num_kv_heads,
                                                        int group_size, int block_shift, float scale_log2,
                                                        int sliding_window, int causal) {
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
    const bf16* k_plane = kv_cache + kv_head * HEAD_DIM;
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
    for_each_kv_tile<HEAD_DIM>(
        k_tile, v_tile, k_plane, k_plane + plane_elems, block_table, block_shift, num_kv_heads * HEAD_DIM, lo, hi,
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
        const float inverse = 1.f / attention.row_sum[r];   // >= 1 key: the row's own position
        unsigned* destination = reinterpret_cast<unsigned*>(out + (first_row + row) * out_stride +
                                                            (long long)head * HEAD_DIM + 2 * t);
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            destination[4 * n] = float2_to_bf16x2(attention.acc[n][2 * r] * inverse,
                                                  attention.acc[n][2 * r + 1] * inverse);
    }
}

}  // namespace

#define PREFILL_KERNEL(HEAD_DIM)                                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) paged_prefill_attention_hd##HEAD_DIM(                     \
        bf16* out, long long out_stride, const bf16* q, long long q_stride, const bf16* kv_cache,                   \
        long long plane_elems, const int* query_starts, const int* query_lens, const int* context_lens,            \
        const int* block_tables, int max_blocks, int num_kv_heads, int group_size, int block_shift,               \
        float scale_log2, int sliding_window, int causal) {                                                         \
        wait_for_previous_kernel();                                                                                  \
        paged_prefill_attention<HEAD_DIM>(out, out_stride, q, q_stride, kv_cache, plane_elems, query_starts,        \
                                          query_lens, context_lens, block_tables, max_blocks, num_kv_heads,         \
                                          group_size, block_shift, scale_log2, sliding_window, causal);             \
    }

PREFILL_KERNEL(32)
PREFILL_KERNEL(64)
PREFILL_KERNEL(128)
