// Sampling primitives, for sampling_search.cuh and sampling.cu: the constants and the per-row parameter
// layout, order keys and ranks of floats, the Philox draw, streaming a row, fixed-point masses and block
// reductions and scans.
#pragma once
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_BUCKETS 2048              // first-level buckets over d = max - x
#define REFINE_BITS 8
#define REFINE_BUCKETS (1 << REFINE_BITS)  // buckets per refinement level over a window of order keys
#define MAX_CANDIDATES 1024              // a power of two, >= blockDim.x: windows this small are sorted
#define LOAD_UNROLL 2                    // float4 loads in flight per thread
#define FLAG_GREEDY 1
#define FLAG_PENALISED 2
#define FLAG_LOGPROBS 4
#define KIND_COUNT 0
#define KIND_MASS 1
#define KEY_NEG_INF 0x007fffffu          // order_key(-inf); NaN never gets a key in [KEY_NEG_INF, KEY_POS_INF]
#define KEY_POS_INF 0xff800000u
#define KEY_NAN 0xffffffffu              // argmax: NaN beats every number, as torch.argmax
#define MASS_ONE 8796093022208.0         // 2^43: exp(s) <= 1 in fixed point; V <= 2^20 keeps sums below 2^63
#define MASS_ONE_FLOAT 8796093022208.f   // exp(s) * 2^43 is exact in float32, then rounded to an integer
#define CUT_RANGE 104.f                  // s below -104: exp(s) underflows float32, the token has no mass
#define FLOAT_MAX 3.402823466e38f
#define FULL_MASK 0xffffffffu

typedef unsigned long long u64;

// One row's parameters, 64 bytes; pack_sampling_params in kernels/sampling.py writes the same layout.
struct SampleParams {
    double top_p_limit;        // nextafter(top_p, -1): a token stays while the mass before it is <= this; >= 1 off
    float temperature;
    float min_p;
    float repetition_penalty;
    float frequency_penalty;
    float presence_penalty;
    int top_k;                 // 0 = off
    unsigned int seed_lo, seed_hi, position_lo, position_hi;
    int flags;                 // FLAG_*
    int top_logprobs;          // n best logprobs to report
    int reserved[2];
};

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float not_a_number() { return __int_as_float(0x7fffffff); }

// Order-preserving uint32 of a float (NaN excluded); -0 takes +0's key, as -0 == 0 compares.
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int u = __float_as_uint(x == 0.f ? 0.f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Canonical rank: larger is earlier (value descending, then id ascending); all ranks of a row differ.
__device__ __forceinline__ u64 rank_key(unsigned int key, int id) {
    return ((u64)key << 32) | (unsigned int)~id;
}

__device__ __forceinline__ int rank_id(u64 rank) { return (int)~(unsigned int)rank; }
__device__ __forceinline__ unsigned int rank_order_key(u64 rank) { return (unsigned int)(rank >> 32); }

// Philox4x32-10 (Random123), first output word; counter = (position, 0, 0), key = seed. As philox.py.
__device__ __forceinline__ unsigned int philox_first_word(const SampleParams& p) {
    unsigned int c0 = p.position_lo, c1 = p.position_hi, c2 = 0u, c3 = 0u, k0 = p.seed_lo, k1 = p.seed_hi;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return c0;
}

__device__ __forceinline__ float clamp_finite(float v) {  // torch clamp_(-max, max): NaN stays NaN
    return v > FLOAT_MAX ? FLOAT_MAX : (v < -FLOAT_MAX ? -FLOAT_MAX : v);
}

// f(i, x[i]) for every i < n, each thread a fixed subset: float4 loads where the row allows, LOAD_UNROLL of
// them in flight per thread (a block streams a row from L2 only as fast as it has loads outstanding).
template <typename F>
__device__ __forceinline__ void for_each_value(const float* x, int n, F&& f) {
    const int step = blockDim.x;
    int i = threadIdx.x;
    if (((unsigned long long)x & 15ull) == 0ull && (n & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const int n4 = n >> 2;
        for (; i + (LOAD_UNROLL - 1) * step < n4; i += LOAD_UNROLL * step) {
            float4 v[LOAD_UNROLL];
#pragma unroll
            for (int u = 0; u < LOAD_UNROLL; ++u) v[u] = x4[i + u * step];
#pragma unroll
            for (int u = 0; u < LOAD_UNROLL; ++u) {
                const int j = 4 * (i + u * step);
                f(j, v[u].x);
                f(j + 1, v[u].y);
                f(j + 2, v[u].z);
                f(j + 3, v[u].w);
            }
        }
        for (; i < n4; i += step) {
            const float4 v = x4[i];
            f(4 * i, v.x);
            f(4 * i + 1, v.y);
            f(4 * i + 2, v.z);
            f(4 * i + 3, v.w);
        }
    } else {
        for (; i + (4 * LOAD_UNROLL - 1) * step < n; i += 4 * LOAD_UNROLL * step) {
            float v[4 * LOAD_UNROLL];
#pragma unroll
            for (int u = 0; u < 4 * LOAD_UNROLL; ++u) v[u] = x[i + u * step];
#pragma unroll
            for (int u = 0; u < 4 * LOAD_UNROLL; ++u) f(i + u * step, v[u]);
        }
        for (; i < n; i += step) f(i, x[i]);
    }
}

// The same over a row of bf16 (raw bits), each value widened to float32: 16-byte loads of 8 values where x is
// 16-byte aligned, then the last n % 8 one by one. Each thread still visits its ids in increasing order.
template <typename F>
__device__ __forceinline__ void for_each_value(const bf16* x, int n, F&& f) {
    const int step = blockDim.x;
    int i = threadIdx.x, tail = 0;
    if (((unsigned long long)x & 15ull) == 0ull) {
        const uint4* x8 = reinterpret_cast<const uint4*>(x);
        const int n8 = n >> 3;
        const auto each = [&](int j, const uint4& v) {
            const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float2 pair = bf16x2_to_float2(words[w]);
                f(j + 2 * w, pair.x);
                f(j + 2 * w + 1, pair.y);
            }
        };
        for (; i + (LOAD_UNROLL - 1) * step < n8; i += LOAD_UNROLL * step) {
            uint4 v[LOAD_UNROLL];
#pragma unroll
            for (int u = 0; u < LOAD_UNROLL; ++u) v[u] = x8[i + u * step];
#pragma unroll
            for (int u = 0; u < LOAD_UNROLL; ++u) each(8 * (i + u * step), v[u]);
        }
        for (; i < n8; i += step) each(8 * i, x8[i]);
        tail = 8 * n8;
    }
    for (int j = tail + (int)threadIdx.x; j < n; j += step) f(j, bf16_to_float(x[j]));
}

// One value of a row, as for_each_value passes it.
__device__ __forceinline__ float value_at(const float* x, int i) { return x[i]; }
__device__ __forceinline__ float value_at(const bf16* x, int i) { return bf16_to_float(x[i]); }

// *sum += w with two native 32-bit shared atomics (a 64-bit atomic add is a compare-and-swap loop): the low
// word's add returns the old value, so each add knows its own carry into the high word. Little-endian.
__device__ __forceinline__ void atomic_add_mass(u64* sum, u64 w) {
    unsigned int* words = reinterpret_cast<unsigned int*>(sum);
    const unsigned int low = (unsigned int)w;
    const unsigned int old = atomicAdd(&words[0], low);
    const unsigned int high = (unsigned int)(w >> 32) + (old + low < old ? 1u : 0u);
    if (high) atomicAdd(&words[1], high);
}

// ---- block reductions (block_reduce, common.cuh); each starts with __syncthreads, so calls can follow each other

__device__ __forceinline__ u64 block_max_u64(u64 v) { return block_reduce(v, (u64)0, Max()); }
__device__ __forceinline__ unsigned int block_min_u32(unsigned int v) { return block_reduce(v, 0xffffffffu, Min()); }
__device__ __forceinline__ float block_max_float(float v) { return block_reduce(v, -positive_infinity(), Max()); }
__device__ __forceinline__ double block_sum_double(double v) { return block_reduce(v, 0.0, Sum()); }

// Exclusive prefix sum over the block in thread order; *total gets the sum of all.
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64* total) {
    __shared__ u64 warp_totals[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inclusive = v;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const u64 other = __shfl_up_sync(FULL_MASK, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    __syncthreads();
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    u64 before = 0, sum = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        const u64 t = warp_totals[w];
        before += w < warp ? t : 0ull;
        sum += t;
    }
    *total = sum;
    return before + inclusive - v;
}
