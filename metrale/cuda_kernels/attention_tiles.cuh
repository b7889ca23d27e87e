// The tile machinery of causal attention over the paged KV cache on tensor cores (mma.sync m16n8k16, bf16 in,
// fp32 accumulate), shared by decode_attention.cu and prefill_attention.cu: K/V tiles read through the block
// table with cp.async, the fragments, the online softmax of one warp's 16 rows, and the K/V tile loop.
//
// q [T, num_heads * head_dim] bf16, row stride q_stride (elements; q may be a column slice of qkv).
// kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16, contiguous; plane 0 = K, 1 = V;
//   plane_elems = num_blocks * block_size * num_kv_heads * head_dim. An FP8 cache (the kernels' _fp8 entries)
//   holds e4m3 values in the same layout, a byte each, with a scale a kv head for K and for V (kv_scales
//   [2, num_kv_heads] float32): its tiles widen to bf16 exactly in shared memory, K's scale multiplies
//   scale_log2 and V's the output, so the fragments and the softmax below are the bf16 cache's.
//   Token k of a sequence lives in block block_table[k / block_size], row k % block_size. block_size is a power of
//   two dividing KV_TILE.
// block_tables [S, max_blocks] int32; out [T, num_heads * head_dim] bf16, row stride out_stride.
// Query head h attends with kv head h / group_size. The queries of a segment are the last positions of its
// context; a query at position p sees keys max(0, p - window + 1) .. p (window <= 0: no window).
// Softmax runs in base 2: scores are multiplied by scale_log2 = scale * log2(e), exponentials are ex2.
//
// Fragment layouts relied on (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// lane = 4 * g + t, g = lane >> 2 in 0..7, t = lane & 3; each .b32 holds two bf16, the lower index in the
// low half (as in memory, and as float2_to_bf16x2(lo, hi) packs them):
//   A 16x16, row-major: a0 = A[g][2t, 2t+1]  a1 = A[g+8][2t, 2t+1]  a2 = A[g][2t+8, 2t+9]  a3 = A[g+8][2t+8, 2t+9]
//   B 16x8, "col":      b0 = B[2t, 2t+1][g]  b1 = B[2t+8, 2t+9][g]
//   C/D 16x8 fp32:      c0, c1 = C[g][2t], C[g][2t+1]   c2, c3 = C[g+8][2t], C[g+8][2t+1]
// With ldmatrix (mma.cuh: matrix i's rows from lanes 8i .. 8i+7; register i gets M_i[g][2t, 2t+1], or with
// .trans M_i[2t][g], M_i[2t+1][g]), and K and V tiles stored token-major ([token][dim], rows padded to HEAD_DIM + 8):
//   S = Q K^T: A = Q rows (ldmatrix of Q), B[k = dim][n = token] = K[token][dim] (ldmatrix, no .trans);
//   O += P V:  A = P from the S accumulators (c0,c1 | c2,c3 of two 8-key tiles = a0,a1 | a2,a3),
//              B[k = token][n = dim] = V[token][dim] (ldmatrix .trans).
#pragma once
#include "mma.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int KV_TILE = 64;                // keys per K or V tile in shared memory
constexpr int PREFILL_ROWS = 16 * WARPS;   // query rows of a prefill CTA: 16 per warp
constexpr int DECODE_ROWS = 16;            // query heads of a kv group, padded to one mma tile

template <int HEAD_DIM>
struct Tile {
    static constexpr int STRIDE = HEAD_DIM + 8;              // elements; the 16-byte pad makes ldmatrix conflict-free
    static constexpr int ELEMS = KV_TILE * STRIDE;
    static constexpr int CHUNKS = HEAD_DIM / 8;              // 16-byte chunks per row
    static constexpr int KV_BYTES = 2 * ELEMS * 2;           // a K and a V tile, bf16
    // Decode: the K and V tiles and the group's Q tile, re-read from shared memory at every K tile (Q held in
    // registers costs HEAD_DIM / 4 more of them: 194 instead of 160 at head_dim 128, 2 CTAs per SM instead
    // of 3); then the merge of the 4 warps over the same bytes: acc [WARPS][16][HEAD_DIM], row max and row
    // sum [WARPS][16], fp32.
    static constexpr int DECODE_TILES_BYTES = KV_BYTES + DECODE_ROWS * STRIDE * 2;
    static constexpr int MERGE_BYTES = (WARPS * DECODE_ROWS * HEAD_DIM + 2 * WARPS * DECODE_ROWS) * 4;
    static constexpr int DECODE_BYTES = DECODE_TILES_BYTES > MERGE_BYTES ? DECODE_TILES_BYTES : MERGE_BYTES;
    static_assert(HEAD_DIM % 16 == 0 && (KV_TILE * CHUNKS) % THREADS == 0, "head_dim must be a multiple of 16");
    static_assert(PREFILL_ROWS == KV_TILE, "the prefill Q tile is staged in the V tile");
};

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float fast_exp2(float x) {   // ex2(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The cache slot (block x block_size + row) of a sequence's key through its block table.
__device__ __forceinline__ long long cache_slot(const int* block_table, int block_shift, int key) {
    return ((long long)block_table[key >> block_shift] << block_shift) + (key & ((1 << block_shift) - 1));
}

// Keys [tile_start, tile_start + KV_TILE) of one sequence and kv head from one cache plane into a tile;
// keys outside [lo, hi) are zero-filled without touching the block table or the cache.
// plane: the K or V plane, already offset by kv_head * HEAD_DIM; token_stride = num_kv_heads * HEAD_DIM.
template <int HEAD_DIM>
__device__ __forceinline__ void load_kv_tile(bf16* tile, const bf16* plane, const int* block_table, int block_shift,
                                             int token_stride, int tile_start, int lo, int hi) {
    using T = Tile<HEAD_DIM>;
#pragma unroll
    for (int i = 0; i < KV_TILE * T::CHUNKS / THREADS; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int row = chunk / T::CHUNKS, column = (chunk % T::CHUNKS) * 8;
        const int key = tile_start + row;
        const bool valid = key >= lo && key < hi;
        const bf16* source = valid ? plane + cache_slot(block_table, block_shift, key) * token_stride + column : plane;
        copy_async_16(tile + row * T::STRIDE + column, source, valid);
    }
}

// An FP8 cache's tile (load_kv_tile of a plane of e4m3 bytes, its arguments in bytes): the keys' rows land dense
// ([KV_TILE][HEAD_DIM] bytes) at the start of the bf16 tile's buffer, then widen_kv_tile turns them into the bf16
// tile in place.
template <int HEAD_DIM>
struct Fp8Tile {
    static constexpr int CHUNKS = HEAD_DIM / 16;                 // 16-byte chunks per row
    static constexpr int PER_THREAD = KV_TILE * CHUNKS / THREADS;
    static_assert(HEAD_DIM % 16 == 0 && (KV_TILE * CHUNKS) % THREADS == 0, "an FP8 tile is whole chunks a thread");
};

template <int HEAD_DIM>
__device__ __forceinline__ void load_kv_tile(bf16* tile, const unsigned char* plane, const int* block_table,
                                             int block_shift, int token_stride, int tile_start, int lo, int hi) {
    using F = Fp8Tile<HEAD_DIM>;
    unsigned char* bytes = reinterpret_cast<unsigned char*>(tile);
#pragma unroll
    for (int i = 0; i < F::PER_THREAD; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int row = chunk / F::CHUNKS, column = (chunk % F::CHUNKS) * 16;
        const int key = tile_start + row;
        const bool valid = key >= lo && key < hi;
        const unsigned char* source =
            valid ? plane + cache_slot(block_table, block_shift, key) * token_stride + column : plane;
        copy_async_16(bytes + row * HEAD_DIM + column, source, valid);
    }
}

// The landed e4m3 rows of a tile (all copies waited for and visible) -> the bf16 tile, in place: every thread
// takes its chunks into registers, all wait, then each writes its chunks widened. Two barriers; every thread
// of the CTA calls it.
template <int HEAD_DIM>
__device__ __forceinline__ void widen_kv_tile(bf16* tile) {
    using F = Fp8Tile<HEAD_DIM>;
    uint4 raw[F::PER_THREAD];
#pragma unroll
    for (int i = 0; i < F::PER_THREAD; ++i) raw[i] = reinterpret_cast<const uint4*>(tile)[threadIdx.x + i * THREADS];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < F::PER_THREAD; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int row = chunk / F::CHUNKS, column = (chunk % F::CHUNKS) * 16;
        const unsigned words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
        unsigned wide[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            wide[2 * w] = e4m3x2_to_bf16x2(words[w] & 0xffffu);
            wide[2 * w + 1] = e4m3x2_to_bf16x2(words[w] >> 16);
        }
        uint4* destination = reinterpret_cast<uint4*>(tile + row * Tile<HEAD_DIM>::STRIDE + column);
        destination[0] = make_uint4(wide[0], wide[1], wide[2], wide[3]);
        destination[1] = make_uint4(wide[4], wide[5], wide[6], wide[7]);
    }
    __syncthreads();
}

// ROWS query rows of HEAD_DIM into a tile; rows >= valid_rows are zero-filled.
template <int HEAD_DIM, int ROWS>
__device__ __forceinline__ void load_query_tile(bf16* tile, const bf16* first_row, long long row_stride,
                                                int valid_rows) {
    using T = Tile<HEAD_DIM>;
#pragma unroll
    for (int i = 0; i < (ROWS * T::CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        if (ROWS * T::CHUNKS % THREADS != 0 && chunk >= ROWS * T::CHUNKS) break;
        const int row = chunk / T::CHUNKS, column = (chunk % T::CHUNKS) * 8;
        const bool valid = row < valid_rows;
        copy_async_16(tile + row * T::STRIDE + column, valid ? first_row + row * row_stride + column : first_row,
                      valid);
    }
}

// The A fragment of tile rows row0 .. row0 + 15, columns 16 kk .. 16 kk + 15: matrix i is rows
// row0 + 8 (i & 1) .., columns 16 kk + 8 (i >> 1) .., i.e. a0 .. a3 above.
template <int HEAD_DIM>
__device__ __forceinline__ void load_query_fragment(unsigned (&a)[4], const bf16* tile, int row0, int kk) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(a, tile + (row0 + (lane & 15)) * Tile<HEAD_DIM>::STRIDE + 16 * kk + (lane >> 4) * 8);
}

// Online softmax of one warp's 16 query rows; this lane holds rows g and g + 8 (index r = 0, 1). Scores over
// QK_DIM, values of V_DIM (multi-head latent attention's prefill: 192 and 128).
template <int QK_DIM, int V_DIM = QK_DIM>
struct WarpAttention {
    float acc[V_DIM / 8][4];      // unnormalized output, C fragments of 8-column tiles
    float row_max[2];             // running max of the scaled scores (base 2)
    float row_sum[2];             // this lane's share of the sum of exponentials (quad-summed by finish)

    __device__ __forceinline__ void start() {
#pragma unroll
        for (int n = 0; n < V_DIM / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        row_max[0] = row_max[1] = negative_infinity();
        row_sum[0] = row_sum[1] = 0.f;
    }

    // Scores against the KEYS keys of the K tile from row key0, folded into the running max and sum;
    // returns their probabilities as A fragments (one per 16 keys) for add_values. query(kk, a) gives the
    // A fragment of head-dim columns 16 kk ..; with masked, allowed(r, key_in_tile) says which scores
    // count; without, all do.
    template <int KEYS, typename Query, typename Allowed>
    __device__ __forceinline__ void add_scores(unsigned (&probs)[KEYS / 16][4], Query query, const bf16* k_tile,
                                               int key0, float scale_log2, bool masked, Allowed allowed) {
        const int lane = threadIdx.x & 31, t = lane & 3;
        float s[KEYS / 8][4];
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < QK_DIM / 16; ++kk) {
            unsigned a[4];
            query(kk, a);
#pragma unroll
            for (int j = 0; j < KEYS / 16; ++j) {
                // matrices: keys +0..7 dims +0..7 (b0), keys +0..7 dims +8..15 (b1), then keys +8..15 likewise
                unsigned b[4];
                ldmatrix_x4(b, k_tile + (key0 + 16 * j + (lane & 7) + ((lane >> 4) << 3)) * Tile<QK_DIM>::STRIDE +
                                   16 * kk + ((lane >> 3) & 1) * 8);
                mma_bf16(s[2 * j], a, b[0], b[1]);
                mma_bf16(s[2 * j + 1], a, b[2], b[3]);
            }
        }
        float tile_max[2] = {negative_infinity(), negative_infinity()};
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[j][e] * scale_log2;
                if (masked && !allowed(e >> 1, key0 + 8 * j + 2 * t + (e & 1))) x = negative_infinity();
                s[j][e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // the 4 lanes of a quad hold the same two rows
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            const float new_max = fmaxf(row_max[r], tile_max[r]);
            // a row that has seen no key yet keeps max -inf; subtracting 0 keeps its exponentials 0, not NaN
            base[r] = new_max == negative_infinity() ? 0.f : new_max;
            const float correction = fast_exp2(row_max[r] - base[r]);
            row_max[r] = new_max;
            row_sum[r] *= correction;
#pragma unroll
            for (int n = 0; n < V_DIM / 8; ++n) {
                acc[n][2 * r] *= correction;
                acc[n][2 * r + 1] *= correction;
            }
        }
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = fast_exp2(s[j][e] - base[e >> 1]);
                row_sum[e >> 1] += s[j][e];
            }
        }
#pragma unroll
        for (int i = 0; i < KEYS / 16; ++i) {
            probs[i][0] = float2_to_bf16x2(s[2 * i][0], s[2 * i][1]);
            probs[i][1] = float2_to_bf16x2(s[2 * i][2], s[2 * i][3]);
            probs[i][2] = float2_to_bf16x2(s[2 * i + 1][0], s[2 * i + 1][1]);
            probs[i][3] = float2_to_bf16x2(s[2 * i + 1][2], s[2 * i + 1][3]);
        }
    }

    // acc += probs [16 x KEYS] * V tile rows key0 .. key0 + KEYS - 1.
    template <int KEYS>
    __device__ __forceinline__ void add_values(const unsigned (&probs)[KEYS / 16][4], const bf16* v_tile, int key0) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < KEYS / 16; ++i) {
#pragma unroll
            for (int n = 0; n < V_DIM / 16; ++n) {
                // matrices (.trans): keys +0..7 dims +0..7 (b0), keys +8..15 dims +0..7 (b1), then dims +8..15
                unsigned b[4];
                ldmatrix_x4_trans(b, v_tile + (key0 + 16 * i + (lane & 7) + (((lane >> 3) & 1) << 3)) *
                                                  Tile<V_DIM>::STRIDE + 16 * n + (lane >> 4) * 8);
                mma_bf16(acc[2 * n], probs[i], b[0], b[1]);
                mma_bf16(acc[2 * n + 1], probs[i], b[2], b[3]);
            }
        }
    }

    __device__ __forceinline__ void finish() {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
            row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
        }
    }
};

// The K/V loop shared by the attention kernels, over the 64-key tiles holding keys [lo, hi): load_k(tile,
// start) and load_v(tile, start) issue the copies of the tile's K or V rows into its buffer. The caller has
// issued and committed the copy of its Q tile; read_query() runs once it has landed (prefill stages Q in v_tile
// and takes it into registers). K and V alternate so that one streams in while the other is used, and the
// next tile is issued as soon as its buffer is free: V(j) loads during the scores of K(j), K(j + 1) during
// P V(j). (Waiting for K(j) before issuing V(j) saves two of the four barriers but leaves one tile in
// flight instead of two: decode at batch 64 x 4096 fell from 0.85 to 0.74 of copy bandwidth on an H200.)
// step(tile_start, phase) runs phase 0 (scores, K tile ready) and phase 1 (values, V tile ready).
// On return every copy has landed and every warp is done with both tiles.
template <typename LoadK, typename LoadV, typename ReadQuery, typename Step>
__device__ __forceinline__ void for_each_tile(int lo, int hi, LoadK load_k, LoadV load_v, ReadQuery read_query,
                                              Step step) {
    const int first = lo & ~(KV_TILE - 1);
    load_k(first);
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();                // Q visible to all warps
    read_query();
    __syncthreads();                // every warp holds its Q: v_tile is free
    for (int tile = first; tile < hi; tile += KV_TILE) {
        load_v(tile);
        copy_async_commit();
        copy_async_wait<1>();
        __syncthreads();            // K(tile) visible
        step(tile, 0);
        __syncthreads();            // every warp is done with K(tile)
        if (tile + KV_TILE < hi) load_k(tile + KV_TILE);
        copy_async_commit();        // possibly empty: keeps the group count uniform
        copy_async_wait<1>();
        __syncthreads();            // V(tile) visible
        step(tile, 1);
        __syncthreads();            // every warp is done with V(tile)
    }
}

// A cache plane's values: bf16, or an FP8 cache's e4m3 bytes.
template <bool FP8>
struct CacheValue {
    using type = bf16;
};
template <>
struct CacheValue<true> {
    using type = unsigned char;
};

// for_each_tile over the paged KV cache of kv head kv_head: K and V tiles of HEAD_DIM through the block table, from a
// bf16 cache, or (FP8) from one of e4m3 values (kv_cache and plane_elems then in bytes), each tile widened before its
// step sees it.
template <int HEAD_DIM, bool FP8, typename ReadQuery, typename Step>
__device__ __forceinline__ void for_each_kv_tile(bf16* k_tile, bf16* v_tile, const bf16* kv_cache,
                                                 long long plane_elems, int kv_head, const int* block_table,
                                                 int block_shift, int token_stride, int lo, int hi,
                                                 ReadQuery read_query, Step step) {
    using Value = typename CacheValue<FP8>::type;
    const Value* k_plane = reinterpret_cast<const Value*>(kv_cache) + kv_head * HEAD_DIM;
    const Value* v_plane = k_plane + plane_elems;
    for_each_tile(
        lo, hi,
        [&](int start) {
            load_kv_tile<HEAD_DIM>(k_tile, k_plane, block_table, block_shift, token_stride, start, lo, hi);
        },
        [&](int start) {
            load_kv_tile<HEAD_DIM>(v_tile, v_plane, block_table, block_shift, token_stride, start, lo, hi);
        },
        read_query,
        [&](int tile, int phase) {
            if constexpr (FP8) widen_kv_tile<HEAD_DIM>(phase == 0 ? k_tile : v_tile);
            step(tile, phase);
        });
}

}  // namespace
