// DeepSeek sparse attention's indexer (DeepSeek-V3.2, Hy4), its per-token work: the rotary parts of the index
// queries and keys with the key cache write, the per-head weights, and each query's scores over its context (whose
// top-k, the tokens the query attends to, index_top_k.cu chooses).
//
// cache [num_slots, head_dim] bf16: token p of a sequence at row (block_table[p >> block_shift] << block_shift) +
//   (p & (block_size - 1)); block tables [S, max_blocks] int32. A query's score of key j is
//   sum_h weights[h] * relu(q[h] . k_j), the dot products in fp32 on tensor cores (mma.sync m16n8k16, bf16 in;
//   fragments and ldmatrix as attention_tiles.cuh lays them out).
#include "attention_tiles.cuh"

// Rotate-half rotary embedding of rope_dim dims of each head, its first (rope_first: DeepSeek-V3.2) or its last
// (Hy4): q [T, heads * head_dim] (row stride q_stride) in place; k [T, head_dim] (row stride k_stride)
// rotated into cache row slot_mapping[t] (none where negative) with its other dims copied, k itself unchanged.
// cos, sin [P, rope_dim / 2] fp32 at positions[t]. In fp32, each result rounded to bf16 once. An item is two pairs
// (dims i, i + 1 with i + half, i + half + 1) of one head, head `heads` being the key. grid (T).
extern "C" __global__ void rope_and_write_index(bf16* q, long long q_stride, const bf16* k, long long k_stride,
                                                const float* cos, const float* sin, const int* positions,
                                                const int* slot_mapping, bf16* cache, int heads, int head_dim,
                                                int rope_dim, int rope_first) {
    wait_for_previous_kernel();
    const long long token = blockIdx.x;
    const int half = rope_dim / 2, items_per_head = half / 2, rope0 = rope_first ? 0 : head_dim - rope_dim;
    const float* c = cos + (long long)positions[token] * half;
    const float* s = sin + (long long)positions[token] * half;
    const int slot = slot_mapping[token];
    const bf16* key = k + token * k_stride;
    bf16* cache_row = cache + (long long)slot * head_dim;
    for (int item = threadIdx.x; item < (heads + 1) * items_per_head; item += blockDim.x) {
        const int head = item / items_per_head, i = 2 * (item % items_per_head);
        if (head == heads && slot < 0) break;           // the key's items come last
        bf16* head_row = q + token * q_stride + (long long)head * head_dim + rope0;
        const bf16* x = head < heads ? head_row : key + rope0;
        unsigned first = *reinterpret_cast<const unsigned*>(x + i);
        unsigned second = *reinterpret_cast<const unsigned*>(x + half + i);
        const float2 ci = *reinterpret_cast<const float2*>(c + i), si = *reinterpret_cast<const float2*>(s + i);
        rotate_pair2(first, second, ci.x, ci.y, si.x, si.y);
        bf16* y = head < heads ? head_row : cache_row + rope0;
        *reinterpret_cast<unsigned*>(y + i) = first;
        *reinterpret_cast<unsigned*>(y + half + i) = second;
    }
    if (slot < 0) return;
    const int rest = rope_first ? rope_dim : 0;         // the key's dims outside its rotary part, two at a time
    for (int i = 2 * threadIdx.x; i < head_dim - rope_dim; i += 2 * blockDim.x)
        *reinterpret_cast<unsigned*>(cache_row + rest + i) = *reinterpret_cast<const unsigned*>(key + rest + i);
}

namespace {

constexpr int WEIGHT_TOKENS = 8;    // tokens a CTA of index_weights
constexpr int WEIGHT_WARPS = 8;     // warps a CTA of index_weights: each a slice of the head's columns

}  // namespace

// out [T, heads] fp32 (row stride out_stride) = (x [T, hidden] bf16 @ weights_proj [heads, hidden].T fp32) * scale,
// in fp32. grid (ceil(T / 8), heads), 256 threads: the CTA's warps split head blockIdx.y's row of weights_proj, 4
// columns a lane at a time (hidden % 4 == 0), over the CTA's 8 tokens; so each CTA reads its head's row once, and a
// decode's few tokens still spread the rows over a CTA a head.
extern "C" __global__ void __launch_bounds__(32 * WEIGHT_WARPS) index_weights(float* out, long long out_stride,
                                                                             const bf16* x, long long x_stride,
                                                                             const float* weights_proj, int tokens,
                                                                             int heads, int hidden, float scale) {
    wait_for_previous_kernel();
    __shared__ float partial[WEIGHT_WARPS][WEIGHT_TOKENS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, head = blockIdx.y;
    const int token0 = blockIdx.x * WEIGHT_TOKENS, n = min(WEIGHT_TOKENS, tokens - token0);
    const float* w = weights_proj + (long long)head * hidden;
    const bf16* rows = x + token0 * x_stride;
    float acc[WEIGHT_TOKENS] = {};
    for (int i = 4 * threadIdx.x; i < hidden; i += 4 * 32 * WEIGHT_WARPS) {
        const float4 wi = *reinterpret_cast<const float4*>(w + i);
#pragma unroll
        for (int t = 0; t < WEIGHT_TOKENS; ++t) {
            if (t >= n) break;
            const uint2 packed = *reinterpret_cast<const uint2*>(rows + t * x_stride + i);
            const float2 lo = bf16x2_to_float2(packed.x), hi = bf16x2_to_float2(packed.y);
            acc[t] += wi.x * lo.x + wi.y * lo.y + wi.z * hi.x + wi.w * hi.y;
        }
    }
#pragma unroll
    for (int t = 0; t < WEIGHT_TOKENS; ++t) {
        const float sum = warp_sum(acc[t]);
        if (lane == 0) partial[warp][t] = sum;
    }
    __syncthreads();
    if ((int)threadIdx.x < n) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < WEIGHT_WARPS; ++v) sum += partial[v][threadIdx.x];
        out[(token0 + threadIdx.x) * out_stride + head] = sum * scale;
    }
}

namespace {

constexpr int SCORE_TILE = 2 * KV_TILE;             // keys a tile (two load_kv_tile), 32 a warp
constexpr int WARP_KEYS = SCORE_TILE / WARPS;
constexpr int MAX_HEAD_TILES = 8;                   // 16 heads each (the mma's M): at most 128 heads

struct ScoreArgs {
    float* out;                 // [R, >= max_context]: entry r's row
    long long out_stride;
    const bf16* q;              // [T, heads * HEAD_DIM]
    long long q_stride;
    const float* weights;       // [T, heads]
    long long weights_stride;
    const bf16* cache;
    const int* rows;            // [R]: entry r's row of q and weights
    const int* contexts;        // [R]: it scores keys 0 .. contexts[r] - 1
    const int* block_tables;    // [S, max_blocks], the row table_rows[r] (null: row r)
    const int* table_rows;
    int max_blocks;
    int heads, block_shift, max_context;
    int chunk;                  // keys a CTA, a multiple of SCORE_TILE
};

// One warp's 32 keys (rows of `keys`, padded rows of STRIDE) against every head of the query (its 16-head tiles in
// `query`, heads past the last zero): sums[j][e] = sum_h weight[h] * relu(q[h] . k) of key 8 j + 2 t + e, which
// every lane of column t holds. weight[m][r]: head 16 m + g + 8 r's (0 past the last head).
template <int HEAD_DIM>
__device__ __forceinline__ void warp_scores(float (&sums)[4][2], const bf16* query, const bf16* keys,
                                            const float (&weight)[MAX_HEAD_TILES][2], int head_tiles) {
    constexpr int STRIDE = Tile<HEAD_DIM>::STRIDE, STEPS = HEAD_DIM / 16;
    const int lane = threadIdx.x & 31;
    // B fragments [k step][16 keys]: matrices keys +0..7 of dims +0 and +8, then keys +8..15 likewise
    unsigned key_frag[STEPS][2][4];
#pragma unroll
    for (int kk = 0; kk < STEPS; ++kk)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
            ldmatrix_x4(key_frag[kk][jj], keys + (16 * jj + (lane >> 4) * 8 + (lane & 7)) * STRIDE + 16 * kk +
                                              ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) sums[j][0] = sums[j][1] = 0.f;
#pragma unroll
    for (int m = 0; m < MAX_HEAD_TILES; ++m) {
        if (m >= head_tiles) break;
        float acc[4][4] = {};       // heads 16 m + g (+ 8) x keys 8 j + 2 t (+ 1)
#pragma unroll
        for (int kk = 0; kk < STEPS; ++kk) {
            unsigned q_frag[4];
            ldmatrix_x4(q_frag, query + (16 * m + (lane & 15)) * STRIDE + 16 * kk + (lane >> 4) * 8);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                mma_bf16(acc[2 * jj], q_frag, key_frag[kk][jj][0], key_frag[kk][jj][1]);
                mma_bf16(acc[2 * jj + 1], q_frag, key_frag[kk][jj][2], key_frag[kk][jj][3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sums[j][0] += weight[m][0] * fmaxf(acc[j][0], 0.f) + weight[m][1] * fmaxf(acc[j][2], 0.f);
            sums[j][1] += weight[m][0] * fmaxf(acc[j][1], 0.f) + weight[m][1] * fmaxf(acc[j][3], 0.f);
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int offset = 4; offset < 32; offset <<= 1)     // over g: the lanes of column t
                sums[j][e] += __shfl_xor_sync(0xffffffffu, sums[j][e], offset);
}

// grid (R, ceil(max_context / chunk)), THREADS threads, (2 * SCORE_TILE + 16 * head_tiles) * STRIDE * 2 bytes of
// dynamic shared memory. CTA (r, c) writes entry r's scores of keys [c chunk, (c + 1) chunk) below max_context: -inf
// from contexts[r] on, else its query's heads (staged once) against tiles of 128 keys streamed through the block
// table (the next in flight while one is used), each warp 32 keys of a tile. Consecutive CTAs score one chunk for
// consecutive entries: a prompt's tokens read its keys from L2.
template <int HEAD_DIM>
__device__ __forceinline__ void index_scores(const ScoreArgs& a) {
    using T = Tile<HEAD_DIM>;
    constexpr int TILE_ELEMS = SCORE_TILE * T::STRIDE;
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* tiles = reinterpret_cast<bf16*>(shared);       // two key tiles
    bf16* query = tiles + 2 * TILE_ELEMS;                // [16 head_tiles][STRIDE]

    const int entry = blockIdx.x;
    const int context = min(a.contexts[entry], a.max_context);
    const int lo = blockIdx.y * a.chunk, end = min(lo + a.chunk, a.max_context);
    float* out = a.out + (long long)entry * a.out_stride;
    for (int key = max(lo, context) + threadIdx.x; key < end; key += THREADS) out[key] = negative_infinity();
    const int hi = min(end, context);
    if (lo >= hi) return;

    const long long row = a.rows[entry];
    const int head_tiles = (a.heads + 15) / 16;
    const bf16* q = a.q + row * a.q_stride;
    for (int chunk = threadIdx.x; chunk < 16 * head_tiles * T::CHUNKS; chunk += THREADS) {
        const int head = chunk / T::CHUNKS, column = (chunk % T::CHUNKS) * 8;
        const bool valid = head < a.heads;
        copy_async_16(query + head * T::STRIDE + column, valid ? q + head * HEAD_DIM + column : q, valid);
    }
    const int* block_table = a.block_tables + (long long)(a.table_rows ? a.table_rows[entry] : entry) * a.max_blocks;
    auto load_tile = [&](int start, int buffer) {       // keys past hi zero-filled
        bf16* tile = tiles + buffer * TILE_ELEMS;
        load_kv_tile<HEAD_DIM>(tile, a.cache, block_table, a.block_shift, HEAD_DIM, start, 0, hi);
        load_kv_tile<HEAD_DIM>(tile + KV_TILE * T::STRIDE, a.cache, block_table, a.block_shift, HEAD_DIM,
                               start + KV_TILE, 0, hi);
    };
    load_tile(lo, 0);
    copy_async_commit();        // the query and the first tile

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float weight[MAX_HEAD_TILES][2];
    const float* w = a.weights + row * a.weights_stride;
#pragma unroll
    for (int m = 0; m < MAX_HEAD_TILES; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int head = 16 * m + g + 8 * r;
            weight[m][r] = head < a.heads ? w[head] : 0.f;
        }

    for (int start = lo, buffer = 0; start < hi; start += SCORE_TILE, buffer ^= 1) {
        // the other buffer is free: every warp passed the last barrier of the tile before
        if (start + SCORE_TILE < hi) load_tile(start + SCORE_TILE, buffer ^ 1);
        copy_async_commit();    // possibly empty: keeps the group count uniform
        copy_async_wait<1>();
        __syncthreads();
        const int key0 = start + WARP_KEYS * warp;
        if (key0 < hi) {
            float sums[4][2];
            warp_scores<HEAD_DIM>(sums, query, tiles + buffer * TILE_ELEMS + WARP_KEYS * warp * T::STRIDE, weight,
                                  head_tiles);
            if (g < 4) {        // lane (g, t) writes keys 8 g + 2 t, + 1
                const float first = g == 0 ? sums[0][0] : g == 1 ? sums[1][0] : g == 2 ? sums[2][0] : sums[3][0];
                const float second = g == 0 ? sums[0][1] : g == 1 ? sums[1][1] : g == 2 ? sums[2][1] : sums[3][1];
                const int key = key0 + 8 * g + 2 * t;
                if (key < hi) out[key] = first;
                if (key + 1 < hi) out[key + 1] = second;
            }
        }
        __syncthreads();        // every warp is done with the tile
    }
}

}  // namespace

#define INDEX_SCORES_PARAMS                                                                                      \
    float *out, long long out_stride, const bf16 *q, long long q_stride, const float *weights,                   \
        long long weights_stride, const bf16 *cache, const int *rows, const int *contexts, const int *block_tables, \
        const int *table_rows, int max_blocks, int heads, int block_shift, int max_context, int chunk
#define INDEX_SCORES_ENTRY(HEAD_DIM)                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) index_scores_d##HEAD_DIM(INDEX_SCORES_PARAMS) {        \
        wait_for_previous_kernel();                                                                              \
        index_scores<HEAD_DIM>({out, out_stride, q, q_stride, weights, weights_stride, cache, rows, contexts,     \
                                block_tables, table_rows, max_blocks, heads, block_shift, max_context, chunk});   \
    }
INDEX_SCORES_ENTRY(128)     // DeepSeek-V3.2
INDEX_SCORES_ENTRY(64)
INDEX_SCORES_ENTRY(32)      // the tests' tiny models
