// A row as the sampling search reads it: its order keys and mass (the sampled row, or the raw log-softmax row
// for the top-n), first-level buckets, the shared state of one block's search, and one-pass row statistics
// (argmax, smallest value, first NaN, log-sum-exp). For sampling_search.cuh.
#pragma once
#include "sampling_primitives.cuh"

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
template <typename T>
__device__ unsigned int first_nan(const T* x, int n) {
    unsigned int first = (unsigned int)n;
    for_each_value(x, n, [&](int i, float v) {
        if (v != v) first = min(first, (unsigned int)i);
    });
    return block_min_u32(first);
}

// One pass over a row: argmax and smallest value into *stats (thread 0 writes; visible after the next
// __syncthreads); returns this thread's largest value (-inf where it has none).
template <typename T>
__device__ float scan_row(const T* x, int n, RowStats* stats) {
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

// The sum of exp(x - max) over the row, Kahan-summed in float32 per thread, then in float64 over the block.
template <typename T>
__device__ double sum_exp(const T* x, int n, float max) {
    float sum = 0.f, compensation = 0.f;
    for_each_value(x, n, [&](int, float v) {
        const float y = expf(__fsub_rn(v, max)) - compensation;
        const float t = sum + y;
        compensation = (t - sum) - y;
        sum = t;
    });
    return block_sum_double((double)sum - (double)compensation);
}

// log(sum of exp(x - max)) over the row, Kahan-summed in float32 per thread, then in float64 over the block.
template <typename T>
__device__ float log_sum_exp(const T* x, int n, float max) {
    return (float)log(sum_exp(x, n, max));
}
