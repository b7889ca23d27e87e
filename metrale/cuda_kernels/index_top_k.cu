// DeepSeek sparse attention's choice of tokens: the top-k of each row of the indexer's scores (sparse_index.cu's
// index_scores), by a radix select on the scores' order-preserving keys, the chosen columns in ascending order.
#include "common.cuh"

namespace {

constexpr int TOP_K_THREADS = 512;
constexpr int TOP_K_ITEMS = 8;          // keys a thread loads at a time (loads in flight), and columns it compacts
constexpr int RADIX_BINS = 2048;        // the passes take 11, 11 and 10 bits of a key, highest first
constexpr int SPAN = TOP_K_THREADS * TOP_K_ITEMS;   // the items a block loads at a time
static_assert(SPAN < 65536, "the compaction counts a span's keys in 16 bits");

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

// keys[e] = the key of item base + e * TOP_K_THREADS + threadIdx.x of keys[0 .. size) in shared memory, or of the
// row in global memory (0 past size): TOP_K_ITEMS loads issued before any is used, coalesced across the block.
__device__ __forceinline__ void load_keys(unsigned (&out)[TOP_K_ITEMS], const unsigned* keys, const float* row,
                                          bool in_shared, int base, int size) {
#pragma unroll
    for (int e = 0; e < TOP_K_ITEMS; ++e) {
        const int i = base + e * TOP_K_THREADS + threadIdx.x;
        out[e] = i < size ? (in_shared ? keys[i] : order_key(row[i])) : 0u;
    }
}

// visit(i, key) for item i of keys[0 .. size) in shared memory or of the row, SPAN items a round with load_keys'
// loads in flight; items past size come as key 0 with i >= size, so every lane of a warp visits as often (visit may
// vote across the warp).
template <typename Visit>
__device__ __forceinline__ void for_each_key(const unsigned* keys, const float* row, bool in_shared, int size,
                                             Visit visit) {
    for (int base = 0; base < size; base += SPAN) {
        unsigned loaded[TOP_K_ITEMS];
        load_keys(loaded, keys, row, in_shared, base, size);
#pragma unroll
        for (int e = 0; e < TOP_K_ITEMS; ++e) visit(base + e * TOP_K_THREADS + (int)threadIdx.x, loaded[e]);
    }
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
        for_each_key(keys, row, false, n, [&](int i, unsigned key) { if (i < n) keys[i] = key; });
    bool in_shared = staged;    // where the passes read their keys: keys[0 .. size) or the row
    int size = n;
    unsigned prefix = 0, mask = 0, remaining = k;       // the bits chosen; the keys still to take from their bin
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bins = pass < 2 ? RADIX_BINS : RADIX_BINS / 2;
        for (int i = threadIdx.x; i < bins; i += TOP_K_THREADS) histogram[i] = 0;
        __syncthreads();
        for_each_key(keys, row, in_shared, size, [&](int i, unsigned key) {
            count_in_histogram(histogram, (key >> shift) & (bins - 1), i < size && (key & mask) == prefix);
        });
        __syncthreads();
        const Bin chosen = find_bin(histogram, bins, remaining, &found);
        remaining -= chosen.above;
        prefix |= chosen.bin << shift;
        mask |= (unsigned)(bins - 1) << shift;
        if (pass == 0 && !in_shared && chosen.count <= (unsigned)capacity) {
            if (threadIdx.x == 0) collected = 0;
            __syncthreads();
            for_each_key(keys, row, false, n, [&](int i, unsigned key) {
                append(keys, &collected, key, i < n && (key & mask) == prefix);
            });
            __syncthreads();
            in_shared = true;
            size = chosen.count;
        }
    }
    // prefix is the k-th highest key: every key above it is taken, and the first `remaining` equal to it.
    const unsigned above_all = k - remaining;
    unsigned above_before = 0, equal_before = 0;        // in the columns of the chunks before
    for (int base = 0; base < n; base += SPAN) {
        const int first = base + threadIdx.x * TOP_K_ITEMS;
        unsigned item_keys[TOP_K_ITEMS], above = 0, equal = 0;
#pragma unroll
        for (int e = 0; e < TOP_K_ITEMS; ++e) {
            const int column = first + e;
            item_keys[e] = column < n ? (staged ? keys[column] : order_key(row[column])) : 0u;
        }
#pragma unroll
        for (int e = 0; e < TOP_K_ITEMS; ++e) {
            above += first + e < n && item_keys[e] > prefix;
            equal += first + e < n && item_keys[e] == prefix;
        }
        unsigned total;         // above in the low 16 bits, equal in the high (at most SPAN each a chunk)
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
