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
// its 16 rows. grid (num_splits, ceil(num_heads / MHA_WARPS), B), MHA_WARPS warps. The split's keys go 32 at a
// time, every load of a chunk issued at once (a decode step's contexts are short, so the chunk's round trips to
// memory are its cost): lane l reads key base + l's K row and its own dims (l * DIMS ..) of every key's V row. It
// scores its key against the query (in shared memory, fp32, times scale_log2), the warp keeps the running max and
// sum (online softmax), and each lane adds the chunk's V rows weighted by their probabilities. Output, partials
// and the merge of splits exactly as paged_decode_attention's.
constexpr int MHA_WARPS = 4;

template <int DIMS> struct ValueDims;              // a lane's dims of one V row: 2, 4 or 8 bytes
template <> struct ValueDims<1> {
    typedef unsigned short Load;
    __device__ __forceinline__ static void add(float (&acc)[1], float w, Load v) {
        acc[0] += w * bf16_to_float(v);
    }
};
template <> struct ValueDims<2> {
    typedef unsigned int Load;
    __device__ __forceinline__ static void add(float (&acc)[2], float w, Load v) {
        const float2 x = bf16x2_to_float2(v);
        acc[0] += w * x.x;
        acc[1] += w * x.y;
    }
};
template <> struct ValueDims<4> {
    typedef uint2 Load;
    __device__ __forceinline__ static void add(float (&acc)[4], float w, Load v) {
        const float2 x = bf16x2_to_float2(v.x), y = bf16x2_to_float2(v.y);
        acc[0] += w * x.x;
        acc[1] += w * x.y;
        acc[2] += w * y.x;
        acc[3] += w * y.y;
    }
};

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

template <int HEAD_DIM, bool FRESH = false, bool PARTIAL_Q = false>
__device__ __forceinline__ void paged_decode_attention_mha(const DecodeArgs& a, const NewTokens& fresh = {},
                                                           const QueryPartials& partial_q = {}) {
    constexpr int DIMS = HEAD_DIM / 32;           // output dims per lane
    constexpr int K_LOADS = HEAD_DIM / 8;         // uint4 per K row
    using V = ValueDims<DIMS>;
    __shared__ __align__(16) float query[MHA_WARPS][HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int num_heads = a.heads, head = blockIdx.y * MHA_WARPS + warp, split = blockIdx.x, seq = blockIdx.z;
    if (head >= num_heads) return;
    const int num_splits = gridDim.x;
    const int context = a.context_lens[seq];
    const long long row = a.seq_rows[seq];
    const DecodeKeys keys = decode_keys(context, a.sliding_window, split, a.partition_size);
    const int lo = keys.lo, hi = keys.hi;
    if (lo >= hi) return;

    const long long slot_elems = (long long)num_heads * HEAD_DIM;     // one token's K (or V) of every head
    const bf16* k_plane = a.kv_cache + (long long)head * HEAD_DIM;
    const bf16* v_plane = k_plane + a.plane_elems + lane * DIMS;
    const int* block_table = a.block_tables + (long long)seq * a.max_blocks;
    const int block_mask = (1 << a.block_shift) - 1;
    const bool holds_new = FRESH && hi == context;
    // A chunk's loads: lane l's key base + l (its slot and K row) and its dims of every key's V row, all issued at
    // once; zeros past hi and for the new token (FRESH), which is never read from the cache.
    const auto load_chunk = [&](int base, uint4 (&k)[K_LOADS], typename V::Load (&v)[32]) {
        const int key = base + lane, newest = holds_new ? context - 1 - base : -1;
        const bool live = key < hi;
        const int slot = live ? (block_table[key >> a.block_shift] << a.block_shift) + (key & block_mask) : 0;
        const uint4* k_row = reinterpret_cast<const uint4*>(k_plane + slot * slot_elems);
#pragma unroll
        for (int c = 0; c < K_LOADS; ++c) k[c] = live && lane != newest ? k_row[c] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int slot_j = __shfl_sync(0xffffffffu, slot, j);
            v[j] = base + j < hi && j != newest
                       ? *reinterpret_cast<const typename V::Load*>(v_plane + slot_j * slot_elems)
                       : typename V::Load();
        }
    };
    // The first chunk's loads go out before the query's and the new token's write, so that their round trips
    // to memory overlap (the write cannot be passed by a later load, which might alias it).
    uint4 k[K_LOADS];
    typename V::Load v[32];
    load_chunk(lo, k, v);

    const bf16* query_row = a.q + row * a.q_stride + (long long)head * HEAD_DIM;
    constexpr int HALF = HEAD_DIM / 2;
    const float* cos_row = nullptr;
    const float* sin_row = nullptr;
    if (FRESH) {
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
        const float* first = partial_q.partials + row * a.q_stride + (long long)head * HEAD_DIM + lane;
        const bf16* bias = partial_q.bias ? partial_q.bias + head * HEAD_DIM + lane : nullptr;
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
    __syncwarp();

    // The new token (FRESH), in the split that holds its key (context - 1): the warp rotates the key a word pair a
    // lane (dims 2i, 2i + 1 and their partners HALF on), keeps it for the lane that scores it, and writes the key
    // and each lane's dims of the value into the cache. The value is added after the chunk's others: it is last.
    __shared__ __align__(16) unsigned new_key[FRESH ? MHA_WARPS : 1][HEAD_DIM / 2];
    typename V::Load new_value = typename V::Load();
    if (holds_new) {
        const int new_slot = fresh.slots[row];
        const long long column = (long long)head * HEAD_DIM;
        bf16* cache = const_cast<bf16*>(a.kv_cache);
        const unsigned* k_words = reinterpret_cast<const unsigned*>(fresh.k + row * fresh.k_stride + column);
        unsigned* k_out = reinterpret_cast<unsigned*>(cache + new_slot * slot_elems + column);
        for (int i = lane; i < HALF / 2; i += 32) {
            unsigned first = k_words[i], second = k_words[i + HALF / 2];
            rotate_pair2(first, second, cos_row[2 * i], cos_row[2 * i + 1], sin_row[2 * i], sin_row[2 * i + 1]);
            new_key[warp][i] = first;
            new_key[warp][i + HALF / 2] = second;
            if (new_slot >= 0) {
                k_out[i] = first;
                k_out[i + HALF / 2] = second;
            }
        }
        new_value = *reinterpret_cast<const typename V::Load*>(fresh.v + row * fresh.v_stride + column + lane * DIMS);
        if (new_slot >= 0)
            *reinterpret_cast<typename V::Load*>(cache + a.plane_elems + new_slot * slot_elems + column +
                                                 lane * DIMS) = new_value;
        __syncwarp();
    }

    float running_max = negative_infinity(), sum = 0.f, acc[DIMS];
#pragma unroll
    for (int i = 0; i < DIMS; ++i) acc[i] = 0.f;
    for (int base = lo; base < hi; base += 32) {
        if (base != lo) load_chunk(base, k, v);
        const bool live = base + lane < hi;
        const int newest = holds_new ? context - 1 - base : -1;    // the new token's place in the chunk
        const bool new_here = newest >= 0 && newest < 32;
        if (lane == newest) {
#pragma unroll
            for (int c = 0; c < K_LOADS; ++c) k[c] = reinterpret_cast<const uint4*>(new_key[warp])[c];
        }
        const float4* qv = reinterpret_cast<const float4*>(query[warp]);
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < K_LOADS; ++c) {
            const float4 q0 = qv[2 * c], q1 = qv[2 * c + 1];
            const float2 x = bf16x2_to_float2(k[c].x), y = bf16x2_to_float2(k[c].y);
            const float2 z = bf16x2_to_float2(k[c].z), w = bf16x2_to_float2(k[c].w);
            dot += q0.x * x.x + q0.y * x.y + q0.z * y.x + q0.w * y.y + q1.x * z.x + q1.y * z.y + q1.z * w.x +
                   q1.w * w.y;
        }
        const float score = live ? dot : negative_infinity();
        const float new_max = fmaxf(running_max, warp_max(score));    // finite: key lo < hi is in the first chunk
        const float rescale = fast_exp2(running_max - new_max);
        const float p = fast_exp2(score - new_max);                    // 0 past hi
        sum = sum * rescale + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DIMS; ++i) acc[i] *= rescale;
        running_max = new_max;
#pragma unroll
        for (int j = 0; j < 32; ++j) V::add(acc, __shfl_sync(0xffffffffu, p, j), v[j]);   // v[j] is 0 past hi
        if (new_here) V::add(acc, __shfl_sync(0xffffffffu, p, newest), new_value);
    }
    const int d0 = lane * DIMS;
    if (keys.whole) {
        bf16* o = a.out + row * a.out_stride + (long long)head * HEAD_DIM + d0;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) o[i] = float_to_bf16(acc[i] / sum);
    } else {
        const long long part = ((long long)seq * num_heads + head) * num_splits + split;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) a.partial_out[part * HEAD_DIM + d0 + i] = acc[i] / sum;
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
