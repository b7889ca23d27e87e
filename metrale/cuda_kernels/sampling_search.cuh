// Finding a token in a row's canonical order (value descending, ties to the lower id) by its running count
// or mass without sorting the vocabulary: first-level buckets, then narrowing windows of order keys, then a
// sort of the last candidates or a count of tied ids (the method is described in sampling.cu); and a row's n best.
#pragma once
#include "sampling_rows.cuh"

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
template <typename T, typename Keys>
__device__ int nth_id_with_key(SampleShared& sh, const T* x, int n, const Keys keys, unsigned int key,
                               unsigned int index) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int span = ((n + warps - 1) / warps + 31) & ~31;
    const int begin = min(n, warp * span), end = min(n, begin + span);
    unsigned int hits = 0;
    for (int base = begin; base < end; base += 32) {
        const int i = base + lane;
        hits += __popc(__ballot_sync(FULL_MASK, i < end && keys.key(value_at(x, i)) == key));
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
            unsigned int ballot = __ballot_sync(FULL_MASK, i < end && keys.key(value_at(x, i)) == key);
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
template <typename T, typename Keys>
__device__ void resolve_tie(SampleShared& sh, const T* x, int n, const Keys keys, unsigned int key,
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
template <typename T, typename Keys>
__device__ void refine(SampleShared& sh, const T* x, int n, const Keys keys, unsigned int lo, unsigned int hi,
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

// The n best (logprob, id) of the raw row, ties to the lower id, into ids[0, n) and values[0, n).
template <typename T>
__device__ void top_logprobs_of(SampleShared& sh, const T* raw, int n, const LogprobKeys keys, float thread_max,
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
