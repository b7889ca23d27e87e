// Token sampling over float32 logits, one block per row: the rule in metrale/runtime/sampling/sampler.py's
// docstring. apply_penalties writes a penalised copy of the rows that have penalties or a logit_bias;
// sample_rows chooses each row's token (argmax, or top_k / min_p / top_p and the Philox inverse-CDF draw) and
// reports its logprob and the top-n logprobs, both from log_softmax of the raw row.
//
// No sort of the vocabulary: top_k, top_p and the draw each look for the first token of the canonical order
// (x descending, ties by lower id) whose running count or mass passes a target. One pass counts tokens and sums
// their mass into SAMPLE_BUCKETS buckets of d = max - x; the bucket holding the crossing is narrowed over the
// order keys of its values (REFINE_BUCKETS per level) until at most MAX_CANDIDATES tokens are left, which are
// sorted, or a single tied value is left, whose tokens are counted in id order. A token's mass is
// exp((x - max) / temperature) in 2^-43 fixed point: sums are exact in any order, so the kernel is deterministic,
// and they differ from float64 sums of the same values by less than 1e-7 relative.
// Where this can differ from the CPU: expf (2 ulp) against torch's exp, and p = e / sum with the exact sum against
// torch's float32 softmax sum (off by up to ~1e-5 relative at V = 128k), so a decision within about 1e-6 relative
// of a boundary (u * T or min_p against p; top_p, which compares a mass with a constant, within the CPU sum's
// error) can go the other way: a neighbouring token in the canonical order.
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

// *sum += w with two native 32-bit shared atomics (a 64-bit atomic add is a compare-and-swap loop): the low
// word's add returns the old value, so each add knows its own carry into the high word. Little-endian.
__device__ __forceinline__ void atomic_add_mass(u64* sum, u64 w) {
    unsigned int* words = reinterpret_cast<unsigned int*>(sum);
    const unsigned int low = (unsigned int)w;
    const unsigned int old = atomicAdd(&words[0], low);
    const unsigned int high = (unsigned int)(w >> 32) + (old + low < old ? 1u : 0u);
    if (high) atomicAdd(&words[1], high);
}

// ---- block reductions; each starts with __syncthreads, so calls can follow each other ----

__device__ __forceinline__ u64 block_max_u64(u64 v) {
    __shared__ u64 partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, v, offset);
        v = other > v ? other : v;
    }
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0ull;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, v, offset);
        v = other > v ? other : v;
    }
    return v;
}

__device__ __forceinline__ unsigned int block_min_u32(unsigned int v) {
    __shared__ unsigned int partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, offset));
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0xffffffffu;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

__device__ __forceinline__ float block_max_float(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : -positive_infinity();
    return warp_max(v);
}

__device__ __forceinline__ double block_sum_double(double v) {
    __shared__ double partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

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

// ---- what a row is ranked and weighed by ----

// The row the token is chosen from: order keys of x, mass of exp(s), s = (x - max) / temperature as the CPU.
struct SampleKeys {
    float max, temperature;
    unsigned int min_key, max_key;  // of the row: every key lies in [min_key, max_key]
    enum { has_mass = 1 };
    __device__ __forceinline__ unsigned int key(float x) const { return order_key(x); }
    __device__ __forceinline__ float weight(float x) const {
        return expf(__fdiv_rn(__fsub_rn(x, max), temperature));
    }
    __device__ __forceinline__ u64 mass(float x) const { return __float2ull_rn(weight(x) * MASS_ONE_FLOAT); }
    // the same from gap = max - x (x - max is -gap exactly)
    __device__ __forceinline__ u64 mass_of_gap(float gap) const {
        return __float2ull_rn(expf(__fdiv_rn(-gap, temperature)) * MASS_ONE_FLOAT);
    }
    __device__ __forceinline__ u64 mass_of_key(unsigned int k) const { return mass(key_value(k)); }
};

// The raw row for the top-n: order keys of log_softmax(x) = (x - max) - log_sum, as torch computes it; no mass.
struct LogprobKeys {
    float max, log_sum;
    enum { has_mass = 0 };
    __device__ __forceinline__ float logprob(float x) const { return __fsub_rn(__fsub_rn(x, max), log_sum); }
    __device__ __forceinline__ unsigned int key(float x) const { return order_key(logprob(x)); }
    __device__ __forceinline__ u64 mass(float) const { return 0ull; }
    __device__ __forceinline__ u64 mass_of_key(unsigned int) const { return 0ull; }
};

// First-level bucket of x: d = max - x scaled to [0, SAMPLE_BUCKETS); monotone in x, bucket 0 holds the max.
struct Buckets {
    float max, scale;
    __device__ __forceinline__ int of(float x) const { return of_gap(__fsub_rn(max, x)); }
    __device__ __forceinline__ int of_gap(float gap) const {
        // inf * 0 (x = -inf, scale 0) is NaN, and fminf takes the last bucket for it
        return (int)fminf(__fmul_rn(gap, scale), (float)(SAMPLE_BUCKETS - 1));
    }
};

struct Located {          // a token found by its running count or mass in canonical order
    unsigned int key;     // order key of its value
    int id;
    u64 count, mass;      // running count and mass through it
    u64 tie_end_mass;     // running mass through the last token tied with it
};

struct RowStats {           // block-wide results of one pass over a row
    u64 best;               // rank key of the argmax (NaN first, then the lowest id)
    unsigned int min_key;   // order key of the smallest number
    float log_sum;          // where asked: log_softmax = (x - max) - log_sum; NaN until known
};

struct SampleShared {
    SampleParams params;    // this row's; kept here rather than in registers across the passes
    RowStats stats, raw_stats;
    unsigned int bucket_count[SAMPLE_BUCKETS];  // after bucket_histogram: tokens in the buckets before each
    u64 bucket_mass[SAMPLE_BUCKETS];            // likewise their mass
    unsigned int refine_count[REFINE_BUCKETS];
    u64 refine_mass[REFINE_BUCKETS];
    u64 candidates[MAX_CANDIDATES];             // rank keys
    unsigned int warp_hits[32];
    unsigned int candidate_count, total_count;
    u64 total_mass, above_count, above_mass;
    Located located;
    unsigned int window_lo, window_hi, key, nth_warp, nth_rank;
    int bucket, digit, nth_id;
};

// The lowest id holding NaN in x, or n (second pass, for rows whose first pass saw a NaN).
__device__ unsigned int first_nan(const float* x, int n) {
    unsigned int first = (unsigned int)n;
    for_each_value(x, n, [&](int i, float v) {
        if (v != v) first = min(first, (unsigned int)i);
    });
    return block_min_u32(first);
}

// One pass over a row: argmax and smallest value into *stats (thread 0 writes; visible after the next
// __syncthreads); returns this thread's largest value (-inf where it has none).
__device__ float scan_row(const float* x, int n, RowStats* stats) {
    // per thread: the first largest value in id order (each thread visits its ids in increasing order). best
    // starts as NaN so that the first value is taken; a NaN value is only flagged (rows with NaN are redone).
    float best = not_a_number(), smallest = positive_infinity();
    unsigned int best_id = 0xffffffffu;
    bool saw_nan = false;
    for_each_value(x, n, [&](int i, float v) {
        if (!(v <= best)) {
            best = v;
            best_id = (unsigned int)i;
        }
        smallest = fminf(smallest, v);
        saw_nan |= v != v;
    });
    const float thread_max = best_id == 0xffffffffu ? -positive_infinity() : best;
    const float row_max = block_max_float(thread_max);
    unsigned int id = block_min_u32(thread_max == row_max ? best_id : 0xffffffffu);
    unsigned int key = order_key(row_max);
    if (__syncthreads_or(saw_nan)) {
        key = KEY_NAN;
        id = first_nan(x, n);
    }
    const unsigned int min_key = block_min_u32(order_key(smallest));
    if (threadIdx.x == 0) {
        stats->best = rank_key(key, (int)id);
        stats->min_key = min_key;
        stats->log_sum = not_a_number();
    }
    return thread_max;
}

// log(sum of exp(x - max)) over the row, Kahan-summed in float32 per thread, then in float64 over the block.
__device__ float log_sum_exp(const float* x, int n, float max) {
    float sum = 0.f, compensation = 0.f;
    for_each_value(x, n, [&](int, float v) {
        const float y = expf(__fsub_rn(v, max)) - compensation;
        const float t = sum + y;
        compensation = (t - sum) - y;
        sum = t;
    });
    return (float)log(block_sum_double((double)sum - (double)compensation));
}

// Sorts keys[0, count) descending (count <= MAX_CANDIDATES), bitonic over the next power of two.
__device__ void sort_descending(u64* keys, int count) {
    int size = 1;
    while (size < count) size <<= 1;
    for (int i = count + threadIdx.x; i < size; i += blockDim.x) keys[i] = 0ull;
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < size; i += blockDim.x) {
                const int partner = i ^ j;
                if (partner > i) {
                    const u64 a = keys[i], b = keys[partner];
                    if (((i & k) == 0) == (a < b)) {
                        keys[i] = b;
                        keys[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// The window's tokens, at most MAX_CANDIDATES, are in sh.candidates: sort them and find the crossing.
template <typename Keys>
__device__ void resolve_candidates(SampleShared& sh, const Keys keys, int count, u64 above_count, u64 above_mass,
                                   int kind, u64 target) {
    sort_descending(sh.candidates, count);
    const int per = (count + blockDim.x - 1) / blockDim.x;
    const int begin = min(count, (int)threadIdx.x * per), end = min(count, begin + per);
    u64 own = 0ull, total;
    for (int j = begin; j < end; ++j) own += keys.mass_of_key(rank_order_key(sh.candidates[j]));
    const u64 before = above_mass + block_exclusive_scan(own, &total);
    u64 mass = before;
    for (int j = begin; j < end; ++j) {
        const u64 rank = sh.candidates[j];
        const u64 through = mass + keys.mass_of_key(rank_order_key(rank));
        const bool crossing = kind == KIND_COUNT ? above_count + j == target : (mass <= target && target < through);
        if (crossing) {
            sh.located.key = rank_order_key(rank);
            sh.located.id = rank_id(rank);
            sh.located.count = above_count + j + 1;
            sh.located.mass = through;
        }
        mass = through;
    }
    __syncthreads();
    const unsigned int key = sh.located.key;
    mass = before;
    for (int j = begin; j < end; ++j) {
        const unsigned int k = rank_order_key(sh.candidates[j]);
        mass += keys.mass_of_key(k);
        if (k == key && (j + 1 == count || rank_order_key(sh.candidates[j + 1]) != key)) sh.located.tie_end_mass = mass;
    }
    __syncthreads();
}

// Id of the index-th token (0-based, id order) whose key is `key`. Each warp counts a contiguous span of ids.
template <typename Keys>
__device__ int nth_id_with_key(SampleShared& sh, const float* x, int n, const Keys keys, unsigned int key,
                               unsigned int index) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int span = ((n + warps - 1) / warps + 31) & ~31;
    const int begin = min(n, warp * span), end = min(n, begin + span);
    unsigned int hits = 0;
    for (int base = begin; base < end; base += 32) {
        const int i = base + lane;
        hits += __popc(__ballot_sync(FULL_MASK, i < end && keys.key(x[i]) == key));
    }
    if (lane == 0) sh.warp_hits[warp] = hits;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int rank = index;
        int w = 0;
        while (w < warps - 1 && rank >= sh.warp_hits[w]) rank -= sh.warp_hits[w++];
        sh.nth_warp = w;
        sh.nth_rank = rank;
    }
    __syncthreads();
    if (warp == (int)sh.nth_warp) {
        unsigned int rank = sh.nth_rank;
        for (int base = begin; base < end; base += 32) {
            const int i = base + lane;
            unsigned int ballot = __ballot_sync(FULL_MASK, i < end && keys.key(x[i]) == key);
            const unsigned int hits_here = __popc(ballot);
            if (rank < hits_here) {
                for (unsigned int skip = 0; skip < rank; ++skip) ballot &= ballot - 1;
                if (lane == 0) sh.nth_id = base + __ffs(ballot) - 1;
                break;
            }
            rank -= hits_here;
        }
    }
    __syncthreads();
    return sh.nth_id;
}

// More than MAX_CANDIDATES tokens share one value: equal masses, so the crossing is a rank in id order.
template <typename Keys>
__device__ void resolve_tie(SampleShared& sh, const float* x, int n, const Keys keys, unsigned int key,
                            unsigned int count, u64 above_count, u64 above_mass, int kind, u64 target) {
    const u64 mass = keys.mass_of_key(key);
    const u64 index = kind == KIND_COUNT ? target - above_count : (target - above_mass) / mass;
    const int id = nth_id_with_key(sh, x, n, keys, key, (unsigned int)index);
    if (threadIdx.x == 0) {
        sh.located.key = key;
        sh.located.id = id;
        sh.located.count = above_count + index + 1;
        sh.located.mass = above_mass + (index + 1) * mass;
        sh.located.tie_end_mass = above_mass + count * mass;
    }
    __syncthreads();
}

// The crossing lies among the tokens with keys in [lo, hi]; above_* are the count and mass of the tokens with
// larger keys, above_(kind) <= target < above_(kind) + the window's. Narrows the window until it resolves.
template <typename Keys>
__device__ void refine(SampleShared& sh, const float* x, int n, const Keys keys, unsigned int lo, unsigned int hi,
                       u64 above_count, u64 above_mass, int kind, u64 target) {
    for (;;) {
        const unsigned int range = hi - lo;
        const int shift = range < REFINE_BUCKETS ? 0 : 32 - __clz(range) - REFINE_BITS;
        for (int i = threadIdx.x; i < REFINE_BUCKETS; i += blockDim.x) {
            sh.refine_count[i] = 0u;
            sh.refine_mass[i] = 0ull;
        }
        if (threadIdx.x == 0) sh.candidate_count = 0u;
        __syncthreads();
        for_each_value(x, n, [&](int i, float v) {
            const unsigned int k = keys.key(v);
            if (k < lo || k > hi) return;
            const unsigned int slot = atomicAdd(&sh.candidate_count, 1u);
            if (slot < MAX_CANDIDATES) sh.candidates[slot] = rank_key(k, i);
            const unsigned int digit = (hi - k) >> shift;   // 0: the largest keys
            atomicAdd(&sh.refine_count[digit], 1u);
            if (Keys::has_mass) {
                const u64 w = keys.mass(v);
                if (w) atomic_add_mass(&sh.refine_mass[digit], w);
            }
        });
        __syncthreads();
        const unsigned int count = sh.candidate_count;
        if (count <= MAX_CANDIDATES) {
            resolve_candidates(sh, keys, (int)count, above_count, above_mass, kind, target);
            return;
        }
        if (lo == hi) {
            resolve_tie(sh, x, n, keys, lo, count, above_count, above_mass, kind, target);
            return;
        }
        if (threadIdx.x == 0) {
            u64 c = above_count, m = above_mass;
            int digit = 0;
            for (; digit < REFINE_BUCKETS - 1; ++digit) {
                const u64 c_next = c + sh.refine_count[digit], m_next = m + sh.refine_mass[digit];
                if ((kind == KIND_COUNT ? c_next : m_next) > target) break;
                c = c_next;
                m = m_next;
            }
            sh.digit = digit;
            sh.above_count = c;
            sh.above_mass = m;
        }
        __syncthreads();
        above_count = sh.above_count;
        above_mass = sh.above_mass;
        const long long top = (long long)hi - ((long long)sh.digit << shift);
        const long long bottom = top - (1ll << shift) + 1;
        hi = (unsigned int)top;
        lo = bottom > (long long)lo ? (unsigned int)bottom : lo;
    }
}

// The order keys [lo, hi] within [min_key, max_key] of the values in first-level bucket `bucket`, which is at most
// the bucket of min_key (thread 0 only; a binary search).
__device__ void bucket_window(const Buckets buckets, int bucket, unsigned int min_key, unsigned int max_key,
                              unsigned int* lo_out, unsigned int* hi_out) {
    unsigned int lo = min_key, hi = max_key;
    while (lo < hi) {  // smallest key whose bucket is <= bucket
        const unsigned int mid = lo + ((hi - lo) >> 1);
        if (buckets.of(key_value(mid)) <= bucket) hi = mid; else lo = mid + 1;
    }
    *lo_out = lo;
    lo = min_key;
    hi = max_key;
    while (lo < hi) {  // largest key whose bucket is >= bucket
        const unsigned int mid = lo + ((hi - lo + 1) >> 1);
        if (buckets.of(key_value(mid)) >= bucket) lo = mid; else hi = mid - 1;
    }
    *hi_out = lo;
}

// Counts (COUNTS; else left 0) and masses per first-level bucket, turned in place into the count and mass before
// each bucket. RAW_SUM: also returns the sum of exp(x - max), the raw row's softmax sum (this row is the raw row).
template <bool COUNTS, bool RAW_SUM>
__device__ float bucket_histogram(SampleShared& sh, const float* x, int n, const SampleKeys keys,
                                  const Buckets buckets) {
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
        sh.bucket_count[b] = 0u;
        sh.bucket_mass[b] = 0ull;
    }
    __syncthreads();
    float raw_sum = 0.f, compensation = 0.f;  // Kahan
    for_each_value(x, n, [&](int, float v) {
        const float gap = __fsub_rn(keys.max, v);  // x - max = -gap exactly
        const int b = buckets.of_gap(gap);
        if (COUNTS) atomicAdd(&sh.bucket_count[b], 1u);
        const u64 w = keys.mass_of_gap(gap);
        if (w) atomic_add_mass(&sh.bucket_mass[b], w);
        if (RAW_SUM) {
            const float y = expf(-gap) - compensation;
            const float t = raw_sum + y;
            compensation = (t - raw_sum) - y;
            raw_sum = t;
        }
    });
    __syncthreads();
    const int per = (SAMPLE_BUCKETS + blockDim.x - 1) / blockDim.x;
    const int begin = min(SAMPLE_BUCKETS, (int)threadIdx.x * per), end = min(SAMPLE_BUCKETS, begin + per);
    u64 own_count = 0ull, own_mass = 0ull, total_count, total_mass;
    for (int b = begin; b < end; ++b) {
        own_count += sh.bucket_count[b];
        own_mass += sh.bucket_mass[b];
    }
    u64 count = block_exclusive_scan(own_count, &total_count);
    u64 mass = block_exclusive_scan(own_mass, &total_mass);
    for (int b = begin; b < end; ++b) {
        const unsigned int c = sh.bucket_count[b];
        const u64 m = sh.bucket_mass[b];
        sh.bucket_count[b] = (unsigned int)count;
        sh.bucket_mass[b] = mass;
        count += c;
        mass += m;
    }
    if (threadIdx.x == 0) {
        sh.total_count = (unsigned int)total_count;
        sh.total_mass = total_mass;
    }
    const float log_sum = RAW_SUM ? (float)log(block_sum_double((double)raw_sum - (double)compensation)) : 0.f;
    __syncthreads();
    return log_sum;
}

// The first token whose running count (KIND_COUNT) or mass (KIND_MASS) passes target < the row's total.
__device__ void locate(SampleShared& sh, const float* x, int n, const SampleKeys keys, const Buckets buckets,
                       int kind, u64 target) {
    const int per = (SAMPLE_BUCKETS + blockDim.x - 1) / blockDim.x;
    const int begin = min(SAMPLE_BUCKETS, (int)threadIdx.x * per), end = min(SAMPLE_BUCKETS, begin + per);
    for (int b = begin; b < end; ++b) {
        const bool last = b + 1 == SAMPLE_BUCKETS;
        const u64 before = kind == KIND_COUNT ? (u64)sh.bucket_count[b] : sh.bucket_mass[b];
        const u64 through = kind == KIND_COUNT ? (u64)(last ? sh.total_count : sh.bucket_count[b + 1])
                                               : (last ? sh.total_mass : sh.bucket_mass[b + 1]);
        if (before <= target && target < through) sh.bucket = b;
    }
    __syncthreads();
    const int bucket = sh.bucket;
    if (threadIdx.x == 0) bucket_window(buckets, bucket, keys.min_key, keys.max_key, &sh.window_lo, &sh.window_hi);
    __syncthreads();
    refine(sh, x, n, keys, sh.window_lo, sh.window_hi, sh.bucket_count[bucket], sh.bucket_mass[bucket], kind, target);
}

// Mass of the tokens with keys >= key: the buckets before key's bucket, plus one pass over that bucket.
__device__ u64 mass_from_key(SampleShared& sh, const float* x, int n, const SampleKeys keys, const Buckets buckets,
                             unsigned int key) {
    const int bucket = buckets.of(key_value(key));
    if (threadIdx.x == 0) bucket_window(buckets, bucket, keys.min_key, keys.max_key, &sh.window_lo, &sh.window_hi);
    __syncthreads();
    const unsigned int hi = sh.window_hi;
    u64 own = 0ull, total;
    for_each_value(x, n, [&](int, float v) {
        const unsigned int k = order_key(v);
        if (k >= key && k <= hi) own += keys.mass(v);
    });
    block_exclusive_scan(own, &total);
    return sh.bucket_mass[bucket] + total;
}

// Smallest order key whose p = exp(s) / sum is > 0 and >= threshold (thread 0 only); p is monotone in x.
__device__ unsigned int lowest_kept_key(const SampleKeys keys, float sum, float threshold) {
    unsigned int lo = KEY_NEG_INF, hi = keys.max_key;
    while (lo < hi) {
        const unsigned int mid = lo + ((hi - lo) >> 1);
        const float p = __fdiv_rn(keys.weight(key_value(mid)), sum);
        if (p > 0.f && p >= threshold) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// The sampled token of a row (temperature > 0), or -1 where the CPU raises (NaN or +inf, no finite max).
// raw_log_sum: x is the raw row and its log-sum-exp is wanted: set sh.raw_stats.log_sum on the way.
__device__ int sample_token(SampleShared& sh, const float* x, int n, bool raw_log_sum) {
    const SampleParams& p = sh.params;
    const RowStats& scan = sh.stats;
    const unsigned int max_key = rank_order_key(scan.best);
    const float temperature = p.temperature;
    if (max_key >= KEY_POS_INF || max_key <= KEY_NEG_INF || !(temperature > 0.f)) return -1;
    SampleKeys keys;
    keys.max = key_value(max_key);
    keys.temperature = temperature;
    keys.min_key = scan.min_key;
    keys.max_key = max_key;
    const float spread = fminf(__fsub_rn(keys.max, key_value(scan.min_key)), CUT_RANGE * temperature);
    float scale = spread > 0.f ? (float)SAMPLE_BUCKETS / spread : 0.f;
    if (!(scale <= FLOAT_MAX)) scale = FLOAT_MAX;
    Buckets buckets;
    buckets.max = keys.max;
    buckets.scale = scale;
    const bool top_k = p.top_k > 0 && p.top_k < n;
    float log_sum;
    if (raw_log_sum && temperature != 1.f) {
        log_sum = top_k ? bucket_histogram<true, true>(sh, x, n, keys, buckets)
                        : bucket_histogram<false, true>(sh, x, n, keys, buckets);
    } else {
        if (top_k) bucket_histogram<true, false>(sh, x, n, keys, buckets);
        else bucket_histogram<false, false>(sh, x, n, keys, buckets);
        log_sum = (float)log((double)sh.total_mass * (1.0 / MASS_ONE));  // temperature 1: the masses are exp(x - max)
    }
    if (raw_log_sum && threadIdx.x == 0) sh.raw_stats.log_sum = log_sum;

    // top_k: the k-th largest value and every token tied with it stay
    unsigned int keep_key = scan.min_key;
    u64 keep_mass = sh.total_mass;
    if (top_k) {
        locate(sh, x, n, keys, buckets, KIND_COUNT, (u64)(p.top_k - 1));
        keep_key = sh.located.key;
        keep_mass = sh.located.tie_end_mass;
    }
    // p = exp(s) / sum over what top_k kept; p > 0 and min_p keep the values down to a lowest key
    const float sum = (float)((double)keep_mass * (1.0 / MASS_ONE));
    const float threshold = __fmul_rn(p.min_p, __fdiv_rn(1.f, sum));
    if (threadIdx.x == 0) sh.key = lowest_kept_key(keys, sum, threshold);
    __syncthreads();
    const unsigned int min_p_key = sh.key;
    if (min_p_key > keep_key) keep_mass = mass_from_key(sh, x, n, keys, buckets, min_p_key);

    // top_p: the kept head ends at the first token whose running mass passes top_p
    u64 draw_mass = keep_mass;
    if (p.top_p_limit < 1.0) {
        const u64 target = (u64)(p.top_p_limit * (double)sum * MASS_ONE);
        if (target < keep_mass) {
            locate(sh, x, n, keys, buckets, KIND_MASS, target);
            draw_mass = sh.located.mass;
        }
    }
    // the first token whose running mass passes u * T, u = (bits + 0.5) / 2^24: floor(u * T) exactly
    const u64 draw = 2ull * (philox_first_word(p) >> 8) + 1ull;
    const u64 target = (__umul64hi(draw, draw_mass) << 39) | ((draw * draw_mass) >> 25);
    locate(sh, x, n, keys, buckets, KIND_MASS, target);
    return sh.located.id;
}

// The n best (logprob, id) of the raw row, ties to the lower id, into ids[0, n) and values[0, n).
__device__ void top_logprobs_of(SampleShared& sh, const float* raw, int n, const LogprobKeys keys, float thread_max,
                                int count, int* ids, float* values) {
    // every one of the `count` best is at least the count-th largest of the warps' (or threads') maxima: each of
    // those is a token's value (-inf where a warp has none, below every token)
    const int warps = blockDim.x >> 5;
    int groups = blockDim.x;
    if (count <= warps) {
        groups = warps;
        const float warp_best = warp_max(thread_max);
        if ((threadIdx.x & 31) == 0) sh.candidates[threadIdx.x >> 5] = rank_key(keys.key(warp_best), threadIdx.x >> 5);
    } else {
        sh.candidates[threadIdx.x] = rank_key(keys.key(thread_max), threadIdx.x);
    }
    sort_descending(sh.candidates, groups);
    const unsigned int floor_key = rank_order_key(sh.candidates[count - 1]);
    refine(sh, raw, n, keys, floor_key, keys.key(keys.max), 0ull, 0ull, KIND_COUNT, (u64)(count - 1));
    const u64 last = rank_key(sh.located.key, sh.located.id);
    if (threadIdx.x == 0) sh.candidate_count = 0u;
    __syncthreads();
    for_each_value(raw, n, [&](int i, float v) {
        const u64 rank = rank_key(keys.key(v), i);
        if (rank >= last) {
            const unsigned int slot = atomicAdd(&sh.candidate_count, 1u);
            if (slot < MAX_CANDIDATES) sh.candidates[slot] = rank;
        }
    });
    __syncthreads();
    sort_descending(sh.candidates, count);
    if ((int)threadIdx.x < count) {
        const u64 rank = sh.candidates[threadIdx.x];
        ids[threadIdx.x] = rank_id(rank);
        values[threadIdx.x] = key_value(rank_order_key(rank));
    }
}

// logits, processed [N, V] float32 (row strides in elements); processed is read for rows with FLAG_PENALISED.
// tokens [N] int32 (-1: the row has NaN or no finite maximum), logprobs [N] float32 (NaN where not asked);
// top_ids, top_logprobs [N, >= top_n] (may be null with top_n 0): the row's n best, then -1 / NaN up to top_n.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(
        const float* logits, long long logits_stride, const float* processed, long long processed_stride,
        const SampleParams* params, int vocab_size, int* tokens, float* logprobs, int* top_ids,
        long long top_ids_stride, float* top_logprobs, long long top_logprobs_stride, int top_n) {
    wait_for_previous_kernel();
    __shared__ SampleShared sh;
    const int row = blockIdx.x;
    if (threadIdx.x == 0) sh.params = params[row];
    __syncthreads();
    const float* raw = logits + row * logits_stride;
    const bool penalised = (sh.params.flags & FLAG_PENALISED) != 0;
    const float* x = penalised ? processed + row * processed_stride : raw;
    const int n = vocab_size;
    const int top_count = max(0, min(min(sh.params.top_logprobs, top_n), n));
    const bool want_logprobs = (sh.params.flags & FLAG_LOGPROBS) || top_count > 0;

    float thread_max = scan_row(x, n, &sh.stats);  // of the raw row, for the top-n
    if (want_logprobs && penalised) thread_max = scan_row(raw, n, &sh.raw_stats);
    __syncthreads();
    if (!(want_logprobs && penalised)) {
        if (threadIdx.x == 0) sh.raw_stats = sh.stats;
        __syncthreads();
    }
    const unsigned int raw_max_key = rank_order_key(sh.raw_stats.best);
    const bool finite_max = raw_max_key > KEY_NEG_INF && raw_max_key < KEY_POS_INF;  // no NaN, not +-inf
    const bool greedy = (sh.params.flags & FLAG_GREEDY) != 0;
    // the raw row's log-sum-exp: on the way where the sampling passes read the raw row, else a pass of its own
    const bool sum_on_the_way = want_logprobs && !greedy && !penalised;
    const int token = greedy ? rank_id(sh.stats.best) : sample_token(sh, x, n, sum_on_the_way && finite_max);
    if (want_logprobs && !sum_on_the_way && finite_max) {
        const float log_sum = log_sum_exp(raw, n, key_value(raw_max_key));
        if (threadIdx.x == 0) sh.raw_stats.log_sum = log_sum;
    }
    __syncthreads();

    // log_softmax of the raw row, NaN throughout where the row has NaN or no finite maximum (as torch)
    LogprobKeys keys;
    keys.max = key_value(raw_max_key);
    keys.log_sum = sh.raw_stats.log_sum;
    const bool valid = want_logprobs && finite_max && fabsf(keys.log_sum) < positive_infinity();
    if (threadIdx.x == 0) {
        tokens[row] = token;
        logprobs[row] = (sh.params.flags & FLAG_LOGPROBS) && valid && token >= 0 ? keys.logprob(raw[token])
                                                                                 : not_a_number();
    }
    if (top_n <= 0) return;
    int* ids = top_ids + row * top_ids_stride;
    float* values = top_logprobs + row * top_logprobs_stride;
    const int filled = valid ? top_count : 0;
    if (filled > 0) top_logprobs_of(sh, raw, n, keys, thread_max, filled, ids, values);
    for (int j = filled + threadIdx.x; j < top_n; j += blockDim.x) {
        ids[j] = -1;
        values[j] = not_a_number();
    }
}

// Penalised rows (FLAG_PENALISED) of logits copied into processed with penalties and logit_bias, as
// sampler.apply_penalties: the row clamped to +-FLOAT_MAX, then each listed token recomputed from the raw value.
// entries [E, 5] int32, the row's at entry_offsets[row] .. entry_offsets[row + 1], one per distinct token:
// (token id, occurrences in the output tokens if frequency/presence apply else 0, 1 if in the history and the
// repetition penalty applies, first bias in biases, number of biases in list order).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) apply_penalties(
        float* processed, long long processed_stride, const float* logits, long long logits_stride,
        const SampleParams* params, int vocab_size, const int* entry_offsets, const int* entries,
        const float* biases) {
    wait_for_previous_kernel();
    const int row = blockIdx.x;
    const SampleParams p = params[row];
    if (!(p.flags & FLAG_PENALISED)) return;
    const float* raw = logits + row * logits_stride;
    float* out = processed + row * processed_stride;
    for_each_value(raw, vocab_size, [&](int i, float v) { out[i] = clamp_finite(v); });
    __syncthreads();  // the listed tokens below overwrite the copy
    const int first = entry_offsets[row], last = entry_offsets[row + 1];
    for (int e = first + threadIdx.x; e < last; e += blockDim.x) {
        const int* entry = entries + 5ll * e;
        const int id = entry[0], output_count = entry[1], in_history = entry[2], bias_start = entry[3];
        const int bias_count = entry[4];
        float v = raw[id];
        if (in_history) v = v < 0.f ? __fmul_rn(v, p.repetition_penalty) : __fdiv_rn(v, p.repetition_penalty);
        if (output_count) {
            // two roundings, as torch: freq * count, then + presence (no fused multiply-add)
            v = __fsub_rn(v, __fadd_rn(__fmul_rn(p.frequency_penalty, (float)output_count), p.presence_penalty));
        }
        for (int b = 0; b < bias_count; ++b) v = __fadd_rn(v, biases[bias_start + b]);
        out[id] = clamp_finite(v);
    }
}
