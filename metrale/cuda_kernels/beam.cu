// Beam search's candidates, one block per running beam: the `count` best (log-probability, id) of the beam's
// logits row after transformers' processors, best first, ties to the lower id. The search step (on the host,
// runtime/beam/search.py, or on the device, beam_step.cu) adds each beam's running score and keeps the best of its
// beams' candidates: the best `count` continuations over all of a request's beams are among the best `count` of
// each beam, so the vocabulary never leaves the device.
//
// As transformers: the LM head's bf16 logits widened to float32, their log_softmax ((x - max) - log_sum, log_sum
// from a float64 sum), then the beam's banned tokens (no_repeat_ngram_size's, and EOS while min_new_tokens is not
// reached) at -inf. The ban is written into the logits row in place, after its log-sum-exp is taken: the row is
// scratch once read.
#include "sampling_search.cuh"
#include "beam_state.cuh"

#define BF16_NEG_INF ((bf16)0xff80u)

// Swaps v into *x and returns what was there: a compare-and-swap of the 32-bit word that holds it.
__device__ __forceinline__ bf16 exchange_bf16(bf16* x, bf16 v) {
    unsigned int* word = reinterpret_cast<unsigned int*>((unsigned long long)x & ~3ull);
    const int shift = ((unsigned long long)x & 2ull) ? 16 : 0;
    unsigned int old = *word, assumed;
    do {
        assumed = old;
        old = atomicCAS(word, assumed, (assumed & ~(0xffffu << shift)) | ((unsigned int)v << shift));
    } while (old != assumed);
    return (bf16)(old >> shift);
}

// The row's best `count` into ids/values; bans(x) writes -inf at the row's banned ids and returns whether it
// banned any (every thread the same answer). A row with NaN or no finite maximum gets ids -1 and NaN values.
template <typename Bans>
__device__ void row_candidates(SampleShared& sh, bf16* x, int n, int count, int* ids, float* values, Bans bans) {
    float thread_max = scan_row(x, n, &sh.stats);
    __syncthreads();
    const unsigned int max_key = rank_order_key(sh.stats.best);
    if (!(max_key > KEY_NEG_INF && max_key < KEY_POS_INF)) {  // NaN, or no finite maximum: nothing to rank
        for (int j = threadIdx.x; j < count; j += blockDim.x) {
            ids[j] = -1;
            values[j] = not_a_number();
        }
        return;
    }
    LogprobKeys keys;
    keys.max = key_value(max_key);
    keys.log_sum = log_sum_exp(x, n, keys.max);
    if (bans(x)) {
        __syncthreads();                        // the bans are visible to the whole block
        thread_max = scan_row(x, n, &sh.stats);  // top_logprobs_of takes its floor from the rows' own maxima
        __syncthreads();
    }
    top_logprobs_of(sh, x, n, keys, thread_max, count, ids, values);
}

// logits [N, V] bf16 (row stride in elements), overwritten at banned ids. banned_offsets [N + 1] int32: row
// i's banned ids are banned[banned_offsets[i] .. banned_offsets[i + 1]) (ids outside [0, V) are skipped).
// ids_out, values_out [N, count] (count <= SAMPLE_THREADS and <= V): the row's best `count`.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) beam_candidates(
        bf16* logits, long long stride, int vocab_size, const int* banned_offsets, const int* banned, int count,
        int* ids_out, float* values_out) {
    wait_for_previous_kernel();
    __shared__ SampleShared sh;
    const int row = blockIdx.x, n = vocab_size;
    const int first = banned_offsets[row], last = banned_offsets[row + 1];
    row_candidates(sh, logits + row * stride, n, count, ids_out + row * count, values_out + row * count,
                   [&](bf16* x) {
        for (int j = first + (int)threadIdx.x; j < last; j += blockDim.x) {
            const int id = banned[j];
            if (id >= 0 && id < n) x[id] = BF16_NEG_INF;
        }
        return last > first;
    });
}

// The device search's candidates (beam_step.cu), each logits row split in `gridDim.y` parts so that a few rows
// still fill the GPU: beam_state_parts takes each part's maximum, its sum of exp(x - maximum) and its best `count`
// after the bans, and beam_state_merge the row's log-sum-exp and its best `count` of those, as log-probabilities.
// Row i of logits is beam state.rows_beam[i]; its candidates go to the beam's row of state.cand_ids / cand_values
// (state.keep_stride of them); rows of requests whose search ended are skipped.

// The bans of beam `beam` of request r, `generated` tokens into the search, over ids [begin, begin + n) of its
// row: EOS while generated < min_new_tokens, and each token that would repeat one of its n-grams (transformers'
// NoRepeatNGramLogitsProcessor: every earlier window of n - 1 tokens equal to the last n - 1 bans the token that
// followed it), tokens read at `parity`. ban(i) for each banned id, i relative to begin (an id may come twice).
template <typename Ban>
__device__ void ban_state_tokens(const BeamState& s, int beam, int r, int parity, int generated, int begin, int n,
                                 Ban ban) {
    const int cur = s.prompt_len[r] + generated, size = s.ngram[r];
    const int* tokens = s.running + ((long long)parity * s.total_beams + beam) * s.max_len;
    if (generated < s.min_new[r]) {
        for (int j = threadIdx.x; j < s.num_eos; j += blockDim.x) {
            const int id = s.eos[j] - begin;
            if (id >= 0 && id < n) ban(id);
        }
    }
    if (size > 0 && cur >= size) {
        const int* last = tokens + cur - size + 1;    // the beam's last n - 1 tokens
        for (int w = threadIdx.x; w <= cur - size; w += blockDim.x) {
            bool match = true;
            for (int t = 0; t < size - 1 && match; ++t) match = tokens[w + t] == last[t];
            const int id = tokens[w + size - 1] - begin;
            if (match && id >= 0 && id < n) ban(id);
        }
    }
}

// Grid (rows, parts); part p of a row holds ids [p * part_size, ...). Per part: part_max (NaN where the part has
// NaN or +inf, -inf where it is all -inf), part_sum (sum of exp(x - part_max) over the raw values, float64), and
// part_ids (count per part, row ids; -1 where the part is all -inf): its best `count` after the bans, ties to the
// lower id. The bans are written into the logits row, as beam_candidates does.
//
// Two passes over the part. The first takes its maximum and each warp's; then the bans swap -inf in, the thread
// that swaps an id out keeping its raw value's share of the sum. Each of the best `count` after the bans is at
// least the (count + bans)-th largest warp maximum (a ban lowers at most one warp's): the second pass sums
// exp(x - max) and gathers every value at or above that floor, and the gathered are ranked. Where the floor is
// not a number (too few warps, too many bans) or too many values reach it, the part's best come from
// top_logprobs_of's search instead. Two blocks a multiprocessor (32 registers a thread, a few spilled to L1
// outside the passes' loops): at 64 rows of NLLB's vocabulary every part is resident at once, 29.8 -> 25.4 us.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 2) beam_state_parts(
        bf16* logits, long long stride, int vocab_size, const BeamState* state, int parity, int generated,
        int part_size, int count, float* part_max, double* part_sum, int* part_ids, float* part_values) {
    wait_for_previous_kernel();
    __shared__ SampleShared sh;
    __shared__ float warp_best[32];
    __shared__ unsigned int bans;
    const BeamState& s = *state;
    const int begin = blockIdx.y * part_size, n = min(part_size, vocab_size - begin);
    const int part = blockIdx.x * gridDim.y + blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    bf16* x = logits + blockIdx.x * stride + begin;
    int* ids = part_ids + (long long)part * count;
    float* values = part_values + (long long)part * count;
    if (threadIdx.x == 0) {
        bans = 0u;
        sh.candidate_count = 0u;
    }
    // The first pass's loads go out before the beam's state is read (rows_beam, beam_request, done: three dependent
    // round trips, now in the pass's shadow); a row whose search ended makes the pass for nothing, as the padding
    // row it is until its request leaves the forward.
    float thread_max = -positive_infinity();
    bool unbounded = false;                                    // NaN or +inf: the row has no finite maximum
    for_each_value(x, n, [&](int, float v) {
        thread_max = fmaxf(thread_max, v);
        unbounded |= !(v < positive_infinity());
    });
    const int beam = s.rows_beam[blockIdx.x], r = s.beam_request[beam];
    if (s.done[r]) return;                                     // the whole block: its row's
    const float best = warp_max(thread_max);
    if (lane == 0) warp_best[warp] = best;
    const float max = block_max_float(thread_max);            // starts with __syncthreads: bans, warp_best set
    if (__syncthreads_or(unbounded) || max == -positive_infinity()) {
        for (int j = threadIdx.x; j < count; j += blockDim.x) ids[j] = -1;
        if (threadIdx.x == 0) {
            part_max[part] = unbounded ? not_a_number() : -positive_infinity();
            part_sum[part] = 0.0;
        }
        return;
    }
    // exp(x - max) summed in float32 by each thread (a part's share of a row, each term <= 1), then in float64 over
    // the block; __expf's ~2 ulp put the row's log-sum-exp ~1e-7 off the exact one, under float32's own rounding
    // of each log-probability. The second pass costs ~7 instructions a value this way, against ~23 with expf, a
    // Kahan sum and an order key for each (the kernel was issue-bound: 35.8 -> 29.8 us at 64 rows).
    float sum = 0.f;
    const auto add = [&](float gap) { sum += __expf(gap); };     // gap: x - max
    ban_state_tokens(s, beam, r, parity, generated, begin, n, [&](int i) {
        const bf16 raw = exchange_bf16(x + i, BF16_NEG_INF);
        if (raw != BF16_NEG_INF) {                              // this id's first ban
            add(__fsub_rn(bf16_to_float(raw), max));
            atomicAdd(&bans, 1u);
        }
    });
    LogprobKeys keys;
    keys.max = max;
    keys.log_sum = 0.f;                                         // ranks by x - max: the row's order
    const int here = min(count, n);                             // the last part may hold fewer ids than count
    __syncthreads();                                            // the bans are written and counted
    const int floor_rank = count + (int)bans - 1;
    if (threadIdx.x < warps) {                                  // the warp maximum of rank floor_rank, if any
        const float own = warp_best[threadIdx.x];
        int rank = 0;
        for (int w = 0; w < warps; ++w) rank += warp_best[w] > own || (warp_best[w] == own && w < (int)threadIdx.x);
        if (rank == floor_rank) sh.key = own > -positive_infinity() ? keys.key(own) : 0u;
    }
    if (threadIdx.x == 0 && floor_rank >= warps) sh.key = 0u;
    __syncthreads();
    const unsigned int floor_key = sh.key;                       // 0: no floor
    // keys.key(v) >= floor_key, compared as the floats they order (order_key is monotone, -0 taking +0's key)
    const float floor_gap = floor_key ? key_value(floor_key) : positive_infinity();
    for_each_value(x, n, [&](int i, float v) {
        const float gap = __fsub_rn(v, max);
        add(gap);
        if (gap >= floor_gap) {
            const unsigned int slot = atomicAdd(&sh.candidate_count, 1u);
            if (slot < MAX_CANDIDATES) sh.candidates[slot] = rank_key(keys.key(v), i);
        }
    });
    const double total = block_sum_double((double)sum);          // starts with __syncthreads
    const unsigned int gathered = sh.candidate_count;
    if (floor_key && gathered <= MAX_CANDIDATES) {
        for (unsigned int i = threadIdx.x; i < gathered; i += blockDim.x) {
            const u64 own = sh.candidates[i];
            int rank = 0;
            for (unsigned int j = 0; j < gathered; ++j) rank += sh.candidates[j] > own;
            if (rank < here) {
                ids[rank] = rank_id(own) + begin;
                values[rank] = key_value(rank_order_key(own));
            }
        }
    } else {
        thread_max = scan_row(x, n, &sh.stats);                 // the maxima after the bans
        __syncthreads();
        top_logprobs_of(sh, x, n, keys, thread_max, here, ids, values);
        if ((int)threadIdx.x < here) ids[threadIdx.x] += begin;       // the thread that wrote it
    }
    for (int j = here + (int)threadIdx.x; j < count; j += blockDim.x) ids[j] = -1;
    if (threadIdx.x == 0) {
        part_max[part] = max;
        part_sum[part] = total;
    }
}

#define MERGE_THREADS 256
#define MAX_MERGED 1024

// One block per row: the row's maximum and log-sum-exp from its parts', and its best `count` of the parts' best
// (parts * count <= MAX_MERGED, parts <= 32: kernels/beam.py's MAX_PARTS) as log-probabilities ((x - max) -
// log_sum, as beam_candidates); ids -1 and NaN values for a row with NaN or no finite maximum.
//
// Every load goes out at once, before the beam's state is read (three dependent round trips): each warp reads all
// the parts' maxima and sums (a lane each) and reduces them itself, and each thread its ids and their logits (ids
// outside [0, vocab_size) read nothing: a row whose search ended has last step's, or none yet).
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) beam_state_merge(
        const bf16* logits, long long stride, int vocab_size, const BeamState* state, int parts, int count,
        const float* part_max, const double* part_sum, const int* part_ids) {
    wait_for_previous_kernel();
    static_assert(MAX_MERGED % MERGE_THREADS == 0, "each thread holds MAX_MERGED / MERGE_THREADS of the ids");
    constexpr int PER_THREAD = MAX_MERGED / MERGE_THREADS;
    __shared__ u64 ranks[MAX_MERGED];
    const BeamState& s = *state;
    const bf16* x = logits + blockIdx.x * stride;
    const int first = blockIdx.x * parts, total = parts * count, lane = threadIdx.x & 31;
    const float m = lane < parts ? part_max[first + lane] : -positive_infinity();
    const double part = lane < parts ? part_sum[first + lane] : 0.0;
    int own_ids[PER_THREAD];
    float own_values[PER_THREAD];
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int i = threadIdx.x + u * MERGE_THREADS;
        own_ids[u] = i < total ? part_ids[(long long)first * count + i] : -1;
    }
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int id = own_ids[u];
        own_values[u] = id >= 0 && id < vocab_size ? value_at(x, id) : 0.f;
    }
    const int beam = s.rows_beam[blockIdx.x], r = s.beam_request[beam];
    if (s.done[r]) return;                                     // the whole block: its row's
    int* ids = s.cand_ids + (long long)beam * s.keep_stride;
    float* values = s.cand_values + (long long)beam * s.keep_stride;
    const bool nan = __any_sync(0xffffffffu, m != m);
    const float max = warp_max(m);                             // fmaxf: a NaN loses to any number
    const bool finite = m == m && m > -positive_infinity();
    const double sum = warp_reduce(finite ? part * exp((double)m - (double)max) : 0.0, Sum());
    if (nan || !(max > -positive_infinity())) {
        for (int j = threadIdx.x; j < count; j += blockDim.x) {
            ids[j] = -1;
            values[j] = not_a_number();
        }
        return;
    }
    LogprobKeys keys;
    keys.max = max;
    keys.log_sum = (float)log(sum);
    for (int j = threadIdx.x; j < count; j += blockDim.x) ids[j] = -1;   // stays -1 past the parts' ids (a fault)
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int i = threadIdx.x + u * MERGE_THREADS;
        if (i < total) ranks[i] = own_ids[u] < 0 ? 0ull : rank_key(keys.key(own_values[u]), own_ids[u]);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int i = threadIdx.x + u * MERGE_THREADS;
        const u64 own = i < total ? ranks[i] : 0ull;
        if (own == 0ull) continue;
        int rank = 0;
        for (int j = 0; j < total; ++j) rank += ranks[j] > own;
        if (rank < count) {
            ids[rank] = rank_id(own);
            values[rank] = keys.logprob(own_values[u]);
        }
    }
}
