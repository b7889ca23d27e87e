// DeepSeek sparse attention's indexer (DeepSeek-V3.2, Hy4), its per-token work: the rotary parts of the index
// queries and keys with the key cache write, the per-head weights, each query's scores over its context, and the
// top-k of each row of scores (the tokens the query attends to).
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
constexpr int WEIGHT_HEADS = 8;     // heads a CTA of index_weights: one a warp

}  // namespace

// out [T, heads] fp32 (row stride out_stride) = (x [T, hidden] bf16 @ weights_proj [heads, hidden].T fp32) * scale,
// in fp32. grid (ceil(T / 8), ceil(heads / 8)), 256 threads: warp w takes head 8 blockIdx.y + w over the CTA's 8
// tokens, 4 columns a lane at a time (hidden % 4 == 0), so each CTA reads its heads' rows of weights_proj once.
extern "C" __global__ void __launch_bounds__(32 * WEIGHT_HEADS) index_weights(float* out, long long out_stride,
                                                                             const bf16* x, long long x_stride,
                                                                             const float* weights_proj, int tokens,
                                                                             int heads, int hidden, float scale) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31, head = blockIdx.y * WEIGHT_HEADS + (threadIdx.x >> 5);
    const int token0 = blockIdx.x * WEIGHT_TOKENS, n = min(WEIGHT_TOKENS, tokens - token0);
    if (head >= heads) return;
    const float* w = weights_proj + (long long)head * hidden;
    const bf16* rows = x + token0 * x_stride;
    float acc[WEIGHT_TOKENS] = {};
    for (int i = 4 * lane; i < hidden; i += 128) {
        const float4 wi = *reinterpret_cast<const float4*>(w + i);
#pragma unroll
        for (int t = 0; t < WEIGHT_TOKENS; ++t) {
            if (t >= n) break;
            const uint2 packed = *reinterpret_cast<const uint2*>(rows + t * x_stride + i);
            const float2 lo = bf16x2_to_float2(packed.x), hi = bf16x2_to_float2(packed.y);
            acc[t] += wi.x * lo.x + wi.y * lo.y + wi.z * hi.x + wi.w * hi.y;
        }
    }
    float mine = 0.f;           // lane t writes token t's
#pragma unroll
    for (int t = 0; t < WEIGHT_TOKENS; ++t) {
        const float sum = warp_sum(acc[t]);
        if (lane == t) mine = sum;
    }
    if (lane < n) out[(token0 + lane) * out_stride + head] = mine * scale;
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

namespace {

constexpr int TOP_K_THREADS = 512;
constexpr int TOP_K_ITEMS = 4;          // consecutive columns a thread compacts at a time
constexpr int RADIX_BINS = 2048;        // the passes take 11, 11 and 10 bits of a key, highest first

// A float's order-preserving key: x > y <=> order_key(x) > order_key(y), -0 taken as +0 and NaN above everything
// (as torch.topk orders them).
__device__ __forceinline__ unsigned order_key(float x) {
    unsigned bits = __float_as_uint(x);
    if (x != x) bits = 0x7fffffffu;
    else if (bits == 0x80000000u) bits = 0u;
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// histogram[bin] += 1 for each active lane; lanes of one bin add once together (a pass's keys often share a bin).
__device__ __forceinline__ void count_in_histogram(unsigned* histogram, unsigned bin, bool active) {
    const unsigned lanes = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    const unsigned peers = __match_any_sync(lanes, bin);
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(histogram + bin, __popc(peers));
}

// Appends value to list (size: its length) for each lane that takes one, in any order.
__device__ __forceinline__ void append(unsigned* list, unsigned* size, unsigned value, bool take) {
    const unsigned takers = __ballot_sync(0xffffffffu, take);
    const int lane = threadIdx.x & 31;
    unsigned base = 0;
    if (lane == 0 && takers) base = atomicAdd(size, __popc(takers));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (take) list[base + __popc(takers & ((1u << lane) - 1))] = value;
}

// Exclusive prefix sum of v over the block in thread order; total: the block's sum. Starts with a barrier, so calls
// may follow each other.
__device__ __forceinline__ unsigned block_exclusive_sum(unsigned v, unsigned& total) {
    __shared__ unsigned warp_sums[TOP_K_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned inclusive = v;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    unsigned before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < TOP_K_THREADS / 32; ++w) {
        before += w < warp ? warp_sums[w] : 0u;
        total += warp_sums[w];
    }
    return before + inclusive - v;
}

struct Bin {
    unsigned bin;       // the bin holding the remaining-th highest key
    unsigned above;     // the keys in higher bins
    unsigned count;     // the keys in it
};

// The bin of histogram[bins] (counted, every thread past the barrier after) holding the remaining-th highest key;
// every thread gets it. Each thread takes bins / TOP_K_THREADS consecutive bins counting down from the top.
__device__ __forceinline__ Bin find_bin(const unsigned* histogram, int bins, unsigned remaining, Bin* found) {
    constexpr int MOST = RADIX_BINS / TOP_K_THREADS;
    const int per = bins / TOP_K_THREADS;
    unsigned counts[MOST], sum = 0;
#pragma unroll
    for (int e = 0; e < MOST; ++e) {
        counts[e] = e < per ? histogram[bins - 1 - (per * threadIdx.x + e)] : 0u;
        sum += counts[e];
    }
    unsigned total;
    unsigned above = block_exclusive_sum(sum, total);
#pragma unroll
    for (int e = 0; e < MOST; ++e) {
        if (e < per && above < remaining && above + counts[e] >= remaining)
            *found = {(unsigned)(bins - 1 - (per * threadIdx.x + e)), above, counts[e]};
        above += counts[e];
    }
    __syncthreads();
    return *found;
}

}  // namespace

// indices [R, k] int32 (row stride indices_stride): the columns of the min(k, n) highest scores of row r of scores
// [R, >= columns] fp32 (row stride scores_stride) among its first n = min(contexts[r], columns), in ascending column
// order, then -1; counts [R] = min(k, n). Ties at the k-th highest: the lower column first. grid (R), TOP_K_THREADS
// threads, 4 * capacity bytes of dynamic shared memory.
// A radix select over order_key finds the k-th highest key in 3 passes, each a histogram of the keys that match
// the bins chosen so far. A row of n <= capacity is staged in shared memory first; a longer one is read from
// global memory for the first pass, and its keys in the chosen bin are then collected in shared memory where they
// fit (else every pass reads the row). Then a block-wide compaction in column order writes the columns whose key is
// above the k-th, and those equal to it, lowest first, until k.
extern "C" __global__ void __launch_bounds__(TOP_K_THREADS) index_top_k(int* indices, long long indices_stride,
                                                                       int* counts, const float* scores,
                                                                       long long scores_stride, const int* contexts,
                                                                       int columns, int k, int capacity) {
    wait_for_previous_kernel();
    extern __shared__ unsigned keys[];                  // [capacity]: the row's keys, or the collected ones
    __shared__ unsigned histogram[RADIX_BINS];
    __shared__ Bin found;
    __shared__ unsigned collected;
    const long long r = blockIdx.x;
    const int n = max(0, min(contexts[r], columns));
    int* out = indices + r * indices_stride;
    const float* row = scores + r * scores_stride;
    if (n <= k) {
        for (int i = threadIdx.x; i < k; i += TOP_K_THREADS) out[i] = i < n ? i : -1;
        if (threadIdx.x == 0) counts[r] = n;
        return;
    }
    const bool staged = n <= capacity;
    if (staged)
        for (int i = threadIdx.x; i < n; i += TOP_K_THREADS) keys[i] = order_key(row[i]);
    bool in_shared = staged;    // where the passes read their keys: keys[0 .. size) or the row
    int size = n;
    unsigned prefix = 0, mask = 0, remaining = k;       // the bits chosen; the keys still to take from their bin
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bins = pass < 2 ? RADIX_BINS : RADIX_BINS / 2;
        for (int i = threadIdx.x; i < bins; i += TOP_K_THREADS) histogram[i] = 0;
        __syncthreads();
        for (int base = 0; base < size; base += TOP_K_THREADS) {
            const int i = base + threadIdx.x;
            const unsigned key = i < size ? (in_shared ? keys[i] : order_key(row[i])) : 0u;
            count_in_histogram(histogram, (key >> shift) & (bins - 1), i < size && (key & mask) == prefix);
        }
        __syncthreads();
        const Bin chosen = find_bin(histogram, bins, remaining, &found);
        remaining -= chosen.above;
        prefix |= chosen.bin << shift;
        mask |= (unsigned)(bins - 1) << shift;
        if (pass == 0 && !in_shared && chosen.count <= (unsigned)capacity) {
            if (threadIdx.x == 0) collected = 0;
            __syncthreads();
            for (int base = 0; base < n; base += TOP_K_THREADS) {
                const int i = base + threadIdx.x;
                const unsigned key = i < n ? order_key(row[i]) : 0u;
                append(keys, &collected, key, i < n && (key & mask) == prefix);
            }
            __syncthreads();
            in_shared = true;
            size = chosen.count;
        }
    }
    // prefix is the k-th highest key: every key above it is taken, and the first `remaining` equal to it.
    const unsigned above_all = k - remaining;
    unsigned above_before = 0, equal_before = 0;        // in the columns of the chunks before
    for (int base = 0; base < n; base += TOP_K_THREADS * TOP_K_ITEMS) {
        const int first = base + threadIdx.x * TOP_K_ITEMS;
        unsigned item_keys[TOP_K_ITEMS], above = 0, equal = 0;
#pragma unroll
        for (int e = 0; e < TOP_K_ITEMS; ++e) {
            const int column = first + e;
            item_keys[e] = column < n ? (staged ? keys[column] : order_key(row[column])) : 0u;
            above += column < n && item_keys[e] > prefix;
            equal += column < n && item_keys[e] == prefix;
        }
        unsigned total;         // above in the low 16 bits, equal in the high (at most 2048 each a chunk)
        const unsigned before = block_exclusive_sum(above | equal << 16, total);
        unsigned above_here = above_before + (before & 0xffffu), equal_here = equal_before + (before >> 16);
#pragma unroll
        for (int e = 0; e < TOP_K_ITEMS; ++e) {
            const int column = first + e;
            if (column >= n) break;
            if (item_keys[e] > prefix) {
                out[above_here + min(equal_here, remaining)] = column;
                ++above_here;
            } else if (item_keys[e] == prefix) {
                if (equal_here < remaining) out[above_here + equal_here] = column;
                ++equal_here;
            }
        }
        above_before += total & 0xffffu;
        equal_before += total >> 16;
        if (above_before == above_all && equal_before >= remaining) break;     // all k written
    }
    if (threadIdx.x == 0) counts[r] = k;
}
