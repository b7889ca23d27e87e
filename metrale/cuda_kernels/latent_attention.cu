// Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) over the paged latent cache, in the latent space: a
// query row per head of RANK + ROPE values (its part without position folded through the head's k_up, then its
// rotated rotary part), one cached row per token (the normed latent [RANK], then the rotated rotary key [ROPE]),
// which is every head's key, and whose first RANK values are every head's value. The caller applies v_up after.
//
// cache [num_slots, RANK + ROPE] bf16 (blocks of block_size rows, token k of a sequence in block
//   block_table[k / block_size], row k % block_size); q [T, heads * (RANK + ROPE)] bf16, row stride q_stride.
// Softmax in base 2 (scale_log2 = scale * log2(e)), fragments and ldmatrix as in attention_tiles.cuh; a head's
// sink (natural log, not scaled) adds exp(sink) to its denominator with no value: 2^(sink log2(e)) in base 2.
// The _selected entries (DeepSeek sparse attention) attend a list of positions per query instead of a prefix of
// its context; their splits cut the list, as the dense ones cut the context.
#include "attention_tiles.cuh"

namespace {

constexpr int LATENT_TILE = 32;      // cached tokens a tile
constexpr int LATENT_ROWS = 16;      // query heads a CTA: the rows of one mma tile

template <int RANK, int ROPE>
struct Latent {
    static constexpr int LOADERS = THREADS / LATENT_TILE;   // threads that copy a token's row
    static constexpr int WIDTH = RANK + ROPE;
    static constexpr int STRIDE = WIDTH + 8;            // a row in shared memory, padded: ldmatrix conflict-free
    static constexpr int CHUNKS = WIDTH / 8;            // 16-byte chunks a row
    static constexpr int WARP_COLS = RANK / WARPS;      // the output columns a warp accumulates
    static constexpr int K_STEPS = WIDTH / 16;          // the scores' k steps: warp w takes w, w + 4, ..
    static constexpr int WARP_STEPS = (K_STEPS + WARPS - 1) / WARPS;
    static constexpr int TILE_ELEMS = LATENT_TILE * STRIDE, Q_ELEMS = LATENT_ROWS * STRIDE;
    // Two token tiles (the next landing while one is used), the CTA's query rows (bf16), then each warp's
    // partial scores of a tile (fp32, in fragment order).
    static constexpr int SCORES_BYTES = WARPS * LATENT_ROWS * LATENT_TILE * 4;
    static constexpr int SHARED_BYTES = 2 * (2 * TILE_ELEMS + Q_ELEMS) + SCORES_BYTES;
    static_assert(WIDTH % 16 == 0 && WARP_COLS % 8 == 0, "RANK a multiple of 32, ROPE of 16");
    static_assert(THREADS % LATENT_TILE == 0, "a tile's rows shared evenly by the threads");
};

// The arguments of a launch (kernels/latent_attention.py passes them in this order).
struct LatentArgs {
    bf16* out;                  // [T, heads * RANK]: a whole sequence's heads (one split), in the latent space
    long long out_stride;
    const bf16* q;
    long long q_stride;
    const bf16* cache;
    const int* seq_rows;        // each decode query's row of q and out (a prefill segment's first row)
    const int* context_lens;    // the tokens it attends: the first context_lens[i] of its sequence (a segment's)
    const int* block_tables;    // [S, max_blocks], the row table_rows[i] (null: row i)
    const int* table_rows;
    int max_blocks;
    const int* prefill_lens;    // non-null: CTA (i, group, s) takes token i of prefill segment s, in one split
    float* partial_out;         // [S, heads, num_splits, RANK] fp32: a split's normalised output ...
    float* partial_lse;         // [S, heads, num_splits]: ... and its log2-sum-exp (paged_decode_reduce merges them)
    int heads, block_shift;
    float scale_log2;
    int partition_size;
    // _selected entries only (the others ignore them): [rows, selected_stride] positions, ascending, each below
    // its query's context, and [rows] their counts, which stand for context_lens. The row: decode query i's is i,
    // a prefill token's its row of q and out.
    const int* selected;
    const int* selected_counts;
    long long selected_stride;
    const float* sinks;         // [heads] natural-log logits (null: none), in the denominator of whole CTAs only
};

// grid (num_splits, ceil(heads / 16), S decode queries), or (the longest segment's tokens, ceil(heads / 16), S
// prefill segments), THREADS threads, Latent::SHARED_BYTES of dynamic shared memory. CTA (split, group, i) attends
// query i's heads 16 group .. over its tokens [split * partition_size, (split + 1) * partition_size) (SELECTED: its
// list's items there, the tokens at those positions), 32 at a time (the next tile's copy in flight while one is
// used). Each warp scores the 32 tokens against the 16 heads over a quarter of the width (its query fragments held
// in registers), the four partial scores meet in shared memory, and every warp sums them, runs the same online
// softmax, and feeds its probabilities from registers into P V for its RANK / 4 columns. Every warp so keeps the
// same maxima and sums.
template <int RANK, int ROPE, bool SELECTED>
__device__ __forceinline__ void latent_decode_attention(const LatentArgs& a) {
    using L = Latent<RANK, ROPE>;
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* tiles = reinterpret_cast<bf16*>(shared);
    bf16* query = tiles + 2 * L::TILE_ELEMS;
    float4* partial_scores = reinterpret_cast<float4*>(query + L::Q_ELEMS);     // [WARPS][4 n tiles][32 lanes]

    const int head0 = blockIdx.y * LATENT_ROWS, seq = blockIdx.z, num_splits = gridDim.x;
    // This CTA's query: a decode entry's (split blockIdx.x of its context), or token blockIdx.x of a prefill
    // segment, which attends the segment's context up to itself (causal) in one split. SELECTED: `context` is the
    // length of its list, and keys below are indices into the list.
    long long row, selection_row;
    int context, table_row, split;
    if (a.prefill_lens == nullptr) {
        row = a.seq_rows[seq];
        selection_row = seq;
        context = SELECTED ? a.selected_counts[seq] : a.context_lens[seq];
        table_row = a.table_rows != nullptr ? a.table_rows[seq] : seq;
        split = blockIdx.x;
    } else {
        const int i = blockIdx.x, n = a.prefill_lens[seq];
        if (i >= n) return;
        row = a.seq_rows[seq] + i;
        selection_row = row;
        context = SELECTED ? a.selected_counts[row] : a.context_lens[seq] - n + i + 1;
        table_row = seq;
        split = 0;
    }
    const int* selected = SELECTED ? a.selected + selection_row * a.selected_stride : nullptr;
    const int lo = split * a.partition_size, hi = min(context, lo + a.partition_size);
    if (lo >= hi) return;
    const bool whole = (context - 1) / a.partition_size == 0;
    const int rows = min(LATENT_ROWS, a.heads - head0);
    const int* block_table = a.block_tables + (long long)table_row * a.max_blocks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    const bf16* first_query = a.q + row * a.q_stride + (long long)head0 * L::WIDTH;
    for (int chunk = threadIdx.x; chunk < LATENT_ROWS * L::CHUNKS; chunk += THREADS) {
        const int r = chunk / L::CHUNKS, column = (chunk % L::CHUNKS) * 8;
        copy_async_16(query + r * L::STRIDE + column, r < rows ? first_query + r * L::WIDTH + column : first_query,
                      r < rows);
    }

    float acc[L::WARP_COLS / 8][4];
#pragma unroll
    for (int n = 0; n < L::WARP_COLS / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float running_max[2] = {negative_infinity(), negative_infinity()}, sum[2] = {0.f, 0.f};

    // Tokens [start, start + 32) into tile buffer `buffer`, those past hi zero-filled: thread LOADERS r + c
    // copies chunks c, c + LOADERS, .. of row r (one block table lookup a tile), the token at `position` (its
    // key: start + r, or SELECTED the list's item start + r, read a tile ahead so that lookup waits on one load).
    const int loader_row = threadIdx.x / L::LOADERS;
    auto position_of = [&](int key) { return SELECTED ? (key < hi ? selected[key] : 0) : key; };
    auto load_tile = [&](int start, int buffer, int position) {
        const int key = start + loader_row;
        bf16* tile_row = tiles + buffer * L::TILE_ELEMS + loader_row * L::STRIDE;
        const bf16* source = a.cache;
        if (key < hi)
            source += (((long long)block_table[position >> a.block_shift] << a.block_shift) +
                       (position & ((1 << a.block_shift) - 1))) * L::WIDTH;
#pragma unroll
        for (int chunk = threadIdx.x % L::LOADERS; chunk < L::CHUNKS; chunk += L::LOADERS)
            copy_async_16(tile_row + chunk * 8, source + (key < hi ? chunk * 8 : 0), key < hi);
    };
    load_tile(lo, 0, position_of(lo + loader_row));
    copy_async_commit();            // the query rows and the first tile
    int next_position = SELECTED ? position_of(lo + LATENT_TILE + loader_row) : 0;

    // This warp's query fragments (rows 0..15, k steps warp, warp + 4, ..), loaded once the first group lands.
    unsigned q_frag[L::WARP_STEPS][4];
    bool first = true;

    for (int start = lo, buffer = 0; start < hi; start += LATENT_TILE, buffer ^= 1) {
        // The next tile streams into the other buffer (free: every warp passed the last barrier of the tile
        // before) while this one is used.
        if (start + LATENT_TILE < hi)
            load_tile(start + LATENT_TILE, buffer ^ 1, SELECTED ? next_position : start + LATENT_TILE + loader_row);
        if (SELECTED) next_position = position_of(start + 2 * LATENT_TILE + loader_row);
        copy_async_commit();        // possibly empty: keeps the group count uniform
        copy_async_wait<1>();
        __syncthreads();
        if (first) {
            first = false;
#pragma unroll
            for (int i = 0; i < L::WARP_STEPS; ++i)
                if (warp + WARPS * i < L::K_STEPS)
                    ldmatrix_x4(q_frag[i], query + (lane & 15) * L::STRIDE + 16 * (warp + WARPS * i) +
                                               (lane >> 4) * 8);
        }
        const bf16* tile = tiles + buffer * L::TILE_ELEMS;

        // This warp's part of the scores: 16 heads x 32 tokens (n tile j: tokens 8 j ..; rows g, g + 8, tokens
        // 8 j + 2t, + 1), over its k steps. ldmatrix matrices: tokens 8 j .. then 8 (j + 1) .., k +0 and +8.
        float s[4][4] = {};
#pragma unroll
        for (int i = 0; i < L::WARP_STEPS; ++i) {
            const int kk = warp + WARPS * i;
            if (kk >= L::K_STEPS) continue;
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                unsigned k_frag[4];
                ldmatrix_x4(k_frag, tile + (8 * j + (lane >> 4) * 8 + (lane & 7)) * L::STRIDE + 16 * kk +
                                        ((lane >> 3) & 1) * 8);
                mma_bf16(s[j], q_frag[i], k_frag[0], k_frag[1]);
                mma_bf16(s[j + 1], q_frag[i], k_frag[2], k_frag[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
            partial_scores[(warp * 4 + j) * 32 + lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
        __syncthreads();
        float tile_max[2] = {negative_infinity(), negative_infinity()};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                if (w == warp) continue;
                const float4 other = partial_scores[(w * 4 + j) * 32 + lane];
                s[j][0] += other.x;
                s[j][1] += other.y;
                s[j][2] += other.z;
                s[j][3] += other.w;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = start + 8 * j + 2 * t + (e & 1);
                s[j][e] = key < hi ? s[j][e] * a.scale_log2 : negative_infinity();
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[j][e]);
            }
        }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            const float m = fmaxf(running_max[r], tile_max[r]);
            base[r] = m == negative_infinity() ? 0.f : m;      // no token yet: exponentials stay 0, not NaN
            const float correction = fast_exp2(running_max[r] - base[r]);
            running_max[r] = m;
            sum[r] *= correction;
#pragma unroll
            for (int n = 0; n < L::WARP_COLS / 8; ++n) {
                acc[n][2 * r] *= correction;
                acc[n][2 * r + 1] *= correction;
            }
        }
        // The probabilities as the A operand of P V: k step kk is tokens 16 kk .., n tiles 2 kk and 2 kk + 1.
        unsigned p_frag[2][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = fast_exp2(s[j][e] - base[e >> 1]);
                sum[e >> 1] += s[j][e];
            }
            p_frag[j >> 1][2 * (j & 1)] = float2_to_bf16x2(s[j][0], s[j][1]);
            p_frag[j >> 1][2 * (j & 1) + 1] = float2_to_bf16x2(s[j][2], s[j][3]);
        }

        // P [16 x 32] V [32 x this warp's columns]; V's rows are the tile's, its columns the latent's.
        const int col0 = warp * L::WARP_COLS;
#pragma unroll
        for (int kk = 0; kk < LATENT_TILE / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < L::WARP_COLS / 8; n += 2) {
                // matrices (.trans): tokens +0..7 and +8..15 of columns 8 n .., then of 8 (n + 1) .. (the same
                // again where this warp has no column tile n + 1)
                const int second = n + 1 < L::WARP_COLS / 8 ? (lane >> 4) * 8 : 0;
                unsigned v_frag[4];
                ldmatrix_x4_trans(v_frag, tile + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * L::STRIDE + col0 +
                                              8 * n + second);
                mma_bf16(acc[n], p_frag[kk], v_frag[0], v_frag[1]);
                if (n + 1 < L::WARP_COLS / 8) mma_bf16(acc[n + 1], p_frag[kk], v_frag[2], v_frag[3]);
            }
        }
        __syncthreads();        // every warp is done with the tile and the partial scores
    }

    // The row sums: this lane's tokens, then its quad's (every warp holds the same).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    }
    const int num_heads = a.heads;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head_row = g + 8 * r;
        if (head_row >= rows) continue;
        const int head = head0 + head_row;
        // A split's sum leaves the sink out: paged_decode_reduce adds it once. running_max is finite here (the
        // range holds a token); a sink far above it makes total inf and the output 0, its limit.
        const float total = whole && a.sinks != nullptr
                                ? sum[r] + fast_exp2(a.sinks[head] * 1.4426950408889634f - running_max[r])
                                : sum[r];
        const float inverse = 1.f / total;
#pragma unroll
        for (int n = 0; n < L::WARP_COLS / 8; ++n) {
            const int d = warp * L::WARP_COLS + 8 * n + 2 * t;
            const float x = acc[n][2 * r] * inverse, y = acc[n][2 * r + 1] * inverse;
            if (whole) {
                *reinterpret_cast<unsigned*>(a.out + row * a.out_stride + (long long)head * RANK + d) =
                    float2_to_bf16x2(x, y);
            } else {
                const long long part = ((long long)seq * num_heads + head) * num_splits + split;
                *reinterpret_cast<float2*>(a.partial_out + part * RANK + d) = make_float2(x, y);
                if (d == 0) a.partial_lse[part] = running_max[r] + log2f(total);
            }
        }
    }
}

}  // namespace

#define LATENT_PARAMS                                                                                            \
    bf16 *out, long long out_stride, const bf16 *q, long long q_stride, const bf16 *cache, const int *seq_rows, \
        const int *context_lens, const int *block_tables, const int *table_rows, int max_blocks,                \
        const int *prefill_lens, float *partial_out, float *partial_lse, int heads, int block_shift,              \
        float scale_log2, int partition_size, const int *selected, const int *selected_counts,                   \
        long long selected_stride, const float *sinks
#define LATENT_ARGS                                                                                              \
    {out, out_stride, q, q_stride, cache, seq_rows, context_lens, block_tables, table_rows, max_blocks,         \
     prefill_lens, partial_out, partial_lse, heads, block_shift, scale_log2, partition_size, selected,          \
     selected_counts, selected_stride, sinks}
// NAME_r##RANK##_p##ROPE: latent_decode_attention<RANK, ROPE, SELECTED>
#define LATENT_ENTRY(NAME, RANK, ROPE, SELECTED)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_r##RANK##_p##ROPE(LATENT_PARAMS) {              \
        wait_for_previous_kernel();                                                                              \
        latent_decode_attention<RANK, ROPE, SELECTED>(LATENT_ARGS);                                              \
    }
LATENT_ENTRY(latent_decode_attention, 512, 64, false)              // DeepSeek-V2, V2-Lite, V3, Kimi-K2
LATENT_ENTRY(latent_decode_attention, 256, 32, false)              // MiniCPM3
LATENT_ENTRY(latent_decode_attention, 32, 16, false)               // the tests' tiny models
LATENT_ENTRY(latent_decode_attention_selected, 512, 64, true)      // DeepSeek-V3.2
LATENT_ENTRY(latent_decode_attention_selected, 256, 32, true)
LATENT_ENTRY(latent_decode_attention_selected, 32, 16, true)       // the tests' tiny models

// Each token's rotary parts and its cache row: q_rope [T, heads * rope] (head h's rotary part of the query, row
// stride q_stride, rotate-half pairs) rotated at positions[t] into out_rope (head h's at out + h * out_head_stride,
// row stride out_stride: the latent-space query's last ROPE columns); the normed latent [T, rank] (row stride
// latent_stride) then rope_key [T, rope] rotated (row stride key_stride) into cache row slot_mapping[t] (none
// where negative). cos, sin [P, rope / 2] fp32. In fp32, each result rounded to bf16 once. grid (T), block 128.
extern "C" __global__ void rope_and_write_latent(bf16* out, long long out_stride, int out_head_stride,
                                                 const bf16* q_rope, long long q_stride, int q_head_stride,
                                                 const bf16* latent, long long latent_stride, const bf16* rope_key,
                                                 long long key_stride, const float* cos, const float* sin,
                                                 const int* positions, const int* slot_mapping, bf16* cache,
                                                 int heads, int rank, int rope) {
    wait_for_previous_kernel();
    const long long token = blockIdx.x;
    const int half = rope / 2;
    const float* c = cos + (long long)positions[token] * half;
    const float* s = sin + (long long)positions[token] * half;
    const int slot = slot_mapping[token];
    bf16* cache_row = cache + (long long)slot * (rank + rope);
    // pairs (i, i + half) of every head's query part, then of the key (head index `heads`)
    for (int item = threadIdx.x; item < (heads + 1) * half; item += blockDim.x) {
        const int head = item / half, i = item % half;
        const bf16* x = head < heads ? q_rope + token * q_stride + (long long)head * q_head_stride
                                     : rope_key + token * key_stride;
        const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
        const bf16 first = float_to_bf16(x1 * c[i] - x2 * s[i]), second = float_to_bf16(x2 * c[i] + x1 * s[i]);
        if (head < heads) {
            bf16* y = out + token * out_stride + (long long)head * out_head_stride;
            y[i] = first;
            y[i + half] = second;
        } else if (slot >= 0) {
            cache_row[rank + i] = first;
            cache_row[rank + i + half] = second;
        }
    }
    if (slot >= 0)
        for (int i = threadIdx.x; i < rank; i += blockDim.x) cache_row[i] = latent[token * latent_stride + i];
}
