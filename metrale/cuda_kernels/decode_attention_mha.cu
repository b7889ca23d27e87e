// Paged decode attention of a multi-head model (one query head per kv head): a warp per head, with the variants
// that write the rows' new tokens themselves or sum the query from its linear's split-K partials. Splits as
// decode_attention.cu's, merged by its paged_decode_reduce.
#include "decode_attention.cuh"

namespace {

// The decode rows' new tokens, for the multi-head kernel that attends them and writes them itself
// (paged_decode_attention_mha_new, in place of rope_and_write_kv then the attention): row t's key and value are
// rows of k and v [T, num_heads * HEAD_DIM] (row strides in elements); its key and query are rotated as
// rope_and_write_kv rotates them (rotate-half, cos and sin [P, HEAD_DIM / 2] at positions[t]), and its key and
// value go into the cache at slots[t] (none where negative), as that kernel writes them: DecodeArgs' kv_cache, the
// one thing this kernel writes through it.
struct NewTokens {
    const bf16* k;
    long long k_stride;
    const bf16* v;
    long long v_stride;
    const float* cos;
    const float* sin;
    const int* positions;
    const int* slots;
};

// Multi-head attention (one query head per kv head): a warp per head, on CUDA cores. An mma tile would fill one of
// its 16 rows. grid (num_splits, ceil(num_heads / MHA_WARPS), B), MHA_WARPS warps. A decode step's contexts are
// short, so a warp's time is its chain of dependent round trips to memory and the memory instructions between
// them. The sequence's context, its row and (without a sliding window, where the split's first key does not
// depend on the context) the blocks of its first chunk's keys load at once. Then, 32 keys a chunk, the warp loads
// the K and V rows as RowTile lays them out: each load instruction reads whole rows (a few 128-byte lines, not 32),
// a lane 16 bytes of each of UNITS rows. A lane's dot products over its 8 dims are summed over its row group by a
// butterfly that leaves each lane one key's score; the warp keeps the running max and sum (online softmax); each
// lane weights its rows' 8 dims of V by their probabilities, and a last butterfly over the groups leaves each lane
// DIMS dims of the output. Output, partials and the merge of splits exactly as paged_decode_attention's.
constexpr int MHA_WARPS = 4;

// A chunk of 32 K (or V) rows over a warp: UNITS 16-byte units a row, so ROWS_AT_ONCE rows a load instruction;
// lane l holds unit `unit` (l % UNITS) of rows i * ROWS_AT_ONCE + `group` (l / UNITS), i < UNITS.
template <int HEAD_DIM>
struct RowTile {
    static constexpr int UNITS = HEAD_DIM / 8, ROWS_AT_ONCE = 32 / UNITS;
    static_assert(UNITS >= 4 && UNITS <= 16 && (UNITS & (UNITS - 1)) == 0, "head_dim 32, 64 or 128");
};

template <int N> struct Log2 { static constexpr int value = 1 + Log2<N / 2>::value; };
template <> struct Log2<1> { static constexpr int value = 0; };

// The sum over the N lanes of an aligned group (lane bits below N) of each lane's v[0..N): lane u of the group
// ends with the sum of v[u] in v[0] (a butterfly: log2(N) exchanges of half of what is left, N - 1 shuffles).
// Loops of fixed trip counts, fully unrolled: v stays in registers.
template <int N>
__device__ __forceinline__ float group_sum_scatter(float (&v)[N], int lane) {
#pragma unroll
    for (int level = 1; level <= Log2<N>::value; ++level) {
        const int half = N >> level;
        const bool upper = lane & half;
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            if (j < half) {
                const float send = upper ? v[j] : v[j + half], keep = upper ? v[j + half] : v[j];
                v[j] = keep + __shfl_xor_sync(0xffffffffu, send, half);
            }
        }
    }
    return v[0];
}

// The sum over the lanes that share lane bits below FROM (the groups) of each lane's v[0..8): a lane ends with 8 /
// (32 / FROM) consecutive sums in v[0..), starting at element (lane / FROM) * (8 / (32 / FROM)).
template <int FROM>
__device__ __forceinline__ void cross_group_sum_scatter(float (&v)[8], int lane) {
#pragma unroll
    for (int level = 1; level <= Log2<32 / FROM>::value; ++level) {
        const int mask = 32 >> level, left = 8 >> level;
        const bool upper = lane & mask;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j < left) {
                const float send = upper ? v[j] : v[j + left], keep = upper ? v[j + left] : v[j];
                v[j] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
            }
        }
    }
}

__device__ __forceinline__ float dot8(const float4& q0, const float4& q1, const uint4& k) {
    const float2 x = bf16x2_to_float2(k.x), y = bf16x2_to_float2(k.y);
    const float2 z = bf16x2_to_float2(k.z), w = bf16x2_to_float2(k.w);
    return ((q0.x * x.x + q0.y * x.y) + (q0.z * y.x + q0.w * y.y)) +
           ((q1.x * z.x + q1.y * z.y) + (q1.z * w.x + q1.w * w.y));
}

__device__ __forceinline__ void add8(float (&acc)[8], float p, const uint4& v) {
    const float2 x = bf16x2_to_float2(v.x), y = bf16x2_to_float2(v.y);
    const float2 z = bf16x2_to_float2(v.z), w = bf16x2_to_float2(v.w);
    acc[0] += p * x.x;
    acc[1] += p * x.y;
    acc[2] += p * y.x;
    acc[3] += p * y.y;
    acc[4] += p * z.x;
    acc[5] += p * z.y;
    acc[6] += p * w.x;
    acc[7] += p * w.y;
}

// A query handed over as its linear's split-K partials (Ops.cross_attention): q = bf16(partial_0 + .. +
// partial_{splits-1} + bias), summed in fp32 in that order and rounded once, as cuBLASLt's bias epilogue rounds its
// accumulator (and as norm.cu's PartialsRow sums a linear's partials). partials: [splits, T, width] fp32 with
// a.q_stride = width; bias: [width] or null.
constexpr int MAX_Q_PARTIALS = 8;
struct QueryPartials {
    const float* partials;
    long long split_elems;       // T * width: from one partial's element to the next's
    int splits;
    const bf16* bias;
};

// Where a chunk's row comes from: a cache slot (>= 0), the new token's rows, or nothing (zeros).
constexpr int NO_ROW = -1, NEW_ROW = -2;

template <int HEAD_DIM, bool FRESH = false, bool PARTIAL_Q = false>
__device__ __forceinline__ void paged_decode_attention_mha(const DecodeArgs& a, const NewTokens& fresh = {},
                                                           const QueryPartials& partial_q = {}) {
    constexpr int DIMS = HEAD_DIM / 32;           // output dims per lane
    constexpr int UNITS = RowTile<HEAD_DIM>::UNITS, ROWS_AT_ONCE = RowTile<HEAD_DIM>::ROWS_AT_ONCE;
    __shared__ __align__(16) float query[MHA_WARPS][HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int unit = lane % UNITS, group = lane / UNITS;
    const int num_heads = a.heads, head = blockIdx.y * MHA_WARPS + warp, split = blockIdx.x, seq = blockIdx.z;
    if (head >= num_heads) return;
    const int num_splits = gridDim.x;
    // Loaded together: without a window, the blocks of the split's first 32 keys (wherever the context ends: the
    // table's row is read in bounds, and only the live keys' blocks are used), the context and the row.
    const int* block_table = a.block_tables + (long long)seq * a.max_blocks;
    const int first_key = split * a.partition_size;
    const bool early = a.sliding_window <= 0;
    const int early_block = early ? block_table[min((first_key + lane) >> a.block_shift, a.max_blocks - 1)] : 0;
    const int context = a.context_lens[seq];
    const long long row = a.seq_rows[seq];
    const DecodeKeys keys = decode_keys(context, a.sliding_window, split, a.partition_size);
    const int lo = keys.lo, hi = keys.hi;
    if (lo >= hi) return;

    const long long slot_elems = (long long)num_heads * HEAD_DIM;     // one token's K (or V) of every head
    const long long column = (long long)head * HEAD_DIM;
    const uint4* k_plane = reinterpret_cast<const uint4*>(a.kv_cache + column) + unit;
    const uint4* v_plane = reinterpret_cast<const uint4*>(a.kv_cache + a.plane_elems + column) + unit;
    const int block_mask = (1 << a.block_shift) - 1;
    const bool holds_new = FRESH && hi == context;
    // A chunk's loads: lane l finds key base + l's slot, and the warp loads the rows it owns (zeros past hi; the
    // new token's, FRESH, from the new rows, as it is never read from the cache).
    const auto load_chunk = [&](int base, uint4 (&k)[UNITS], uint4 (&v)[UNITS]) {
        const int key = base + lane;
        const bool is_new = holds_new && key == context - 1, cached = key < hi && !is_new;
        const int block = early && base == first_key ? early_block
                                                     : cached ? block_table[key >> a.block_shift] : 0;
        const int source = is_new ? NEW_ROW : cached ? (block << a.block_shift) + (key & block_mask) : NO_ROW;
#pragma unroll
        for (int i = 0; i < UNITS; ++i) {
            const int from = __shfl_sync(0xffffffffu, source, i * ROWS_AT_ONCE + group);
            const long long offset = (long long)max(from, 0) * slot_elems / 8;
            const uint4* k_row = from == NEW_ROW ? reinterpret_cast<const uint4*>(fresh.k + row * fresh.k_stride +
                                                                                  column) + unit
                                                 : k_plane + offset;
            const uint4* v_row = from == NEW_ROW ? reinterpret_cast<const uint4*>(fresh.v + row * fresh.v_stride +
                                                                                  column) + unit
                                                 : v_plane + offset;
            k[i] = from != NO_ROW ? *k_row : make_uint4(0u, 0u, 0u, 0u);
            v[i] = from != NO_ROW ? *v_row : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    // The first chunk's loads go out before the query's and the new token's write, so that their round trips
    // to memory overlap (the write cannot be passed by a later load, which might alias it).
    uint4 k[UNITS], v[UNITS];
    load_chunk(lo, k, v);

    const bf16* query_row = a.q + row * a.q_stride + column;
    constexpr int HALF = HEAD_DIM / 2;
    const bool rotate = FRESH && fresh.cos != nullptr;      // no tables: the model has no rotary embedding
    const float* cos_row = nullptr;
    const float* sin_row = nullptr;
    if (rotate) {
        const long long position = fresh.positions[row];
        cos_row = fresh.cos + position * HALF;
        sin_row = fresh.sin + position * HALF;
        for (int d = lane; d < HALF; d += 32) {     // as rope_and_write_kv: rotated, rounded to bf16
            const float x1 = bf16_to_float(query_row[d]), x2 = bf16_to_float(query_row[d + HALF]);
            const float c = cos_row[d], s = sin_row[d];
            query[warp][d] = bf16_to_float(float_to_bf16(x1 * c - x2 * s)) * a.scale_log2;
            query[warp][d + HALF] = bf16_to_float(float_to_bf16(x2 * c + x1 * s)) * a.scale_log2;
        }
    } else if (PARTIAL_Q) {
        // Every partial's load of the lane's dims issued before the first add.
        const float* first = partial_q.partials + row * a.q_stride + column + lane;
        const bf16* bias = partial_q.bias ? partial_q.bias + column + lane : nullptr;
        float parts[DIMS][MAX_Q_PARTIALS];
#pragma unroll
        for (int i = 0; i < DIMS; ++i) {
#pragma unroll
            for (int s = 0; s < MAX_Q_PARTIALS; ++s) {
                if (s < partial_q.splits) parts[i][s] = first[s * partial_q.split_elems + 32 * i];
            }
        }
#pragma unroll
        for (int i = 0; i < DIMS; ++i) {
            float sum = parts[i][0];
#pragma unroll
            for (int s = 1; s < MAX_Q_PARTIALS; ++s) {
                if (s < partial_q.splits) sum += parts[i][s];
            }
            if (bias) sum += bf16_to_float(bias[32 * i]);
            query[warp][lane + 32 * i] = bf16_to_float(float_to_bf16(sum)) * a.scale_log2;
        }
    } else {
        for (int d = lane; d < HEAD_DIM; d += 32) query[warp][d] = bf16_to_float(query_row[d]) * a.scale_log2;
    }

    // The new token (FRESH), in the split that holds its key (context - 1): the warp writes its key (rotated a word
    // pair a lane: dims 2i, 2i + 1 and their partners HALF on, kept for the lanes that score it) and value into
    // the cache; the lanes that own its rows loaded them from the new rows.
    __shared__ __align__(16) unsigned new_key[FRESH ? MHA_WARPS : 1][HEAD_DIM / 2];
    if (holds_new) {
        const int new_slot = fresh.slots[row];
        bf16* cache = const_cast<bf16*>(a.kv_cache);
        const unsigned* k_words = reinterpret_cast<const unsigned*>(fresh.k + row * fresh.k_stride + column);
        unsigned* k_out = reinterpret_cast<unsigned*>(cache + new_slot * slot_elems + column);
        const unsigned* v_words = reinterpret_cast<const unsigned*>(fresh.v + row * fresh.v_stride + column);
        unsigned* v_out = reinterpret_cast<unsigned*>(cache + a.plane_elems + new_slot * slot_elems + column);
        for (int i = lane; i < HALF / 2; i += 32) {
            unsigned first = k_words[i], second = k_words[i + HALF / 2];
            const unsigned value_first = v_words[i], value_second = v_words[i + HALF / 2];
            if (rotate) {
                rotate_pair2(first, second, cos_row[2 * i], cos_row[2 * i + 1], sin_row[2 * i], sin_row[2 * i + 1]);
                new_key[warp][i] = first;
                new_key[warp][i + HALF / 2] = second;
            }
            if (new_slot >= 0) {
                k_out[i] = first;
                k_out[i + HALF / 2] = second;
                v_out[i] = value_first;
                v_out[i + HALF / 2] = value_second;
            }
        }
    }
    __syncwarp();                                   // the query and the rotated new key are stored
    const float4 q0 = reinterpret_cast<const float4*>(query[warp])[2 * unit];
    const float4 q1 = reinterpret_cast<const float4*>(query[warp])[2 * unit + 1];

    float running_max = negative_infinity(), sum = 0.f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int base = lo; base < hi; base += 32) {
        if (base != lo) load_chunk(base, k, v);
        // Rotated, the new token's key is the warp's copy in shared memory: its row's lanes take their unit of it
        // in place of the unrotated one they loaded (a select for each of k's units: an assignment to k[i] at a
        // run-time i put k in local memory).
        const int newest = holds_new ? context - 1 - base : -1;        // the new token's place in the chunk
        const int rotated_i = rotate && newest >= 0 && newest < 32 && group == newest % ROWS_AT_ONCE
                                  ? newest / ROWS_AT_ONCE : -1;
        const uint4 rotated = rotated_i >= 0 ? reinterpret_cast<const uint4*>(new_key[warp])[unit]
                                             : make_uint4(0u, 0u, 0u, 0u);
        float dots[UNITS];
#pragma unroll
        for (int i = 0; i < UNITS; ++i) dots[i] = dot8(q0, q1, i == rotated_i ? rotated : k[i]);
        // Lane (group, unit) now holds the score of row unit * ROWS_AT_ONCE + group.
        const float dot = group_sum_scatter<UNITS>(dots, lane);
        const bool live = base + unit * ROWS_AT_ONCE + group < hi;
        const float score = live ? dot : negative_infinity();
        const float new_max = fmaxf(running_max, warp_max(score));    // finite: key lo < hi is in the first chunk
        const float rescale = fast_exp2(running_max - new_max);
        const float p = fast_exp2(score - new_max);                    // 0 past hi
        sum = sum * rescale + warp_sum(p);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= rescale;
        running_max = new_max;
#pragma unroll
        for (int i = 0; i < UNITS; ++i)     // row i * ROWS_AT_ONCE + group's score: lane group * UNITS + i
            add8(acc, __shfl_sync(0xffffffffu, p, group * UNITS + i), v[i]);   // v is 0 past hi
    }
    cross_group_sum_scatter<UNITS>(acc, lane);     // lane: dims unit * 8 + group * DIMS ..
    const int d0 = unit * 8 + group * DIMS;
    if (keys.whole) {
        bf16* o = a.out + row * a.out_stride + column + d0;
#pragma unroll
        for (int e = 0; e < DIMS; ++e) o[e] = float_to_bf16(acc[e] / sum);
    } else {
        const long long part = ((long long)seq * num_heads + head) * num_splits + split;
#pragma unroll
        for (int e = 0; e < DIMS; ++e) a.partial_out[part * HEAD_DIM + d0 + e] = acc[e] / sum;
        if (lane == 0) a.partial_lse[part] = running_max + log2f(sum);
    }
}

}  // namespace

DECODE_ENTRY(paged_decode_attention_mha, MHA_WARPS * 32, 32)
DECODE_ENTRY(paged_decode_attention_mha, MHA_WARPS * 32, 64)
DECODE_ENTRY(paged_decode_attention_mha, MHA_WARPS * 32, 128)

#define DECODE_NEW_ENTRY(HEAD_DIM)                                                                               \
    extern "C" __global__ void __launch_bounds__(MHA_WARPS * 32) paged_decode_attention_mha_new_hd##HEAD_DIM(    \
        DECODE_PARAMS, const bf16 *new_k, long long k_stride, const bf16 *new_v, long long v_stride,            \
        const float *cos, const float *sin, const int *positions, const int *slots) {                            \
        wait_for_previous_kernel();                                                                              \
        paged_decode_attention_mha<HEAD_DIM, true>(DECODE_ARGS,                                                  \
                                                   {new_k, k_stride, new_v, v_stride, cos, sin, positions, slots}); \
    }

DECODE_NEW_ENTRY(32)
DECODE_NEW_ENTRY(64)
DECODE_NEW_ENTRY(128)

#define DECODE_PARTIAL_Q_ENTRY(HEAD_DIM)                                                                         \
    extern "C" __global__ void __launch_bounds__(MHA_WARPS * 32) paged_decode_attention_mha_partial_q_hd##HEAD_DIM( \
        DECODE_PARAMS, const float *q_partials, long long split_elems, int splits, const bf16 *q_bias) {         \
        wait_for_previous_kernel();                                                                              \
        const QueryPartials partial_q = {q_partials, split_elems, splits, q_bias};                               \
        paged_decode_attention_mha<HEAD_DIM, false, true>(DECODE_ARGS, {}, partial_q);                           \
    }

DECODE_PARTIAL_Q_ENTRY(32)
DECODE_PARTIAL_Q_ENTRY(64)
DECODE_PARTIAL_Q_ENTRY(128)
