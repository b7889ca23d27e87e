// Beam search's candidates, one block per running beam: the `count` best (log-probability, id) of the beam's
// logits row after transformers' processors, best first, ties to the lower id. The search step (on the host,
// runtime/beam/search.py, or on the device, beam_step.cu) adds each beam's running score and keeps the best of its
// beams' candidates: the best `count` continuations over all of a request's beams are among the best `count` of
// each beam, so the vocabulary never leaves the device.
//
// As transformers: log_softmax of the raw row in float32 ((x - max) - log_sum, log_sum from a float64 sum), then
// the beam's banned tokens (no_repeat_ngram_size's, and EOS while min_new_tokens is not reached) at -inf. The ban
// is written into the logits row in place, after its log-sum-exp is taken: the row is scratch once read.
#include "sampling_search.cuh"
#include "beam_state.cuh"

// The row's best `count` into ids/values; bans(x) writes -inf at the row's banned ids and returns whether it
// banned any (every thread the same answer). A row with NaN or no finite maximum gets ids -1 and NaN values.
template <typename Bans>
__device__ void row_candidates(SampleShared& sh, float* x, int n, int count, int* ids, float* values, Bans bans) {
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

// logits [N, V] float32 (row stride in elements), overwritten at banned ids. banned_offsets [N + 1] int32: row
// i's banned ids are banned[banned_offsets[i] .. banned_offsets[i + 1]) (ids outside [0, V) are skipped).
// ids_out, values_out [N, count] (count <= SAMPLE_THREADS and <= V): the row's best `count`.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) beam_candidates(
        float* logits, long long stride, int vocab_size, const int* banned_offsets, const int* banned, int count,
        int* ids_out, float* values_out) {
    wait_for_previous_kernel();
    __shared__ SampleShared sh;
    const int row = blockIdx.x, n = vocab_size;
    const int first = banned_offsets[row], last = banned_offsets[row + 1];
    row_candidates(sh, logits + row * stride, n, count, ids_out + row * count, values_out + row * count,
                   [&](float* x) {
        for (int j = first + (int)threadIdx.x; j < last; j += blockDim.x) {
            const int id = banned[j];
            if (id >= 0 && id < n) x[id] = -positive_infinity();
        }
        return last > first;
    });
}

// The device search's candidates (beam_step.cu): row i of logits is beam state.rows_beam[i]; its candidates go to
// the beam's row of state.cand_ids / cand_values (state.keep_stride of them), its bans computed here from the
// beam's running tokens at `parity`, `generated` tokens into the search: EOS while generated < min_new_tokens,
// and each token that would repeat one of its n-grams (transformers' NoRepeatNGramLogitsProcessor: every earlier
// window of n - 1 tokens equal to the last n - 1 bans the token that followed it). Rows of requests whose search
// ended are skipped.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) beam_state_candidates(
        float* logits, long long stride, int vocab_size, const BeamState* state, int parity, int generated) {
    wait_for_previous_kernel();
    __shared__ SampleShared sh;
    const BeamState& s = *state;
    const int beam = s.rows_beam[blockIdx.x], r = s.beam_request[beam], n = vocab_size;
    if (s.done[r]) return;
    const int cur = s.prompt_len[r] + generated, size = s.ngram[r];
    const bool short_of_min = generated < s.min_new[r];
    const int* tokens = s.running + ((long long)parity * s.total_beams + beam) * s.max_len;
    const long long out = (long long)beam * s.keep_stride;
    row_candidates(sh, logits + blockIdx.x * stride, n, (int)s.keep_stride, s.cand_ids + out, s.cand_values + out,
                   [&](float* x) {
        if (short_of_min) {
            for (int j = threadIdx.x; j < s.num_eos; j += blockDim.x) {
                const int id = s.eos[j];
                if (id >= 0 && id < n) x[id] = -positive_infinity();
            }
        }
        const bool ngrams = size > 0 && cur >= size;
        if (ngrams) {
            const int* last = tokens + cur - size + 1;    // the beam's last n - 1 tokens
            for (int w = threadIdx.x; w <= cur - size; w += blockDim.x) {
                bool match = true;
                for (int t = 0; t < size - 1 && match; ++t) match = tokens[w + t] == last[t];
                const int id = tokens[w + size - 1];
                if (match && id >= 0 && id < n) x[id] = -positive_infinity();
            }
        }
        return short_of_min || ngrams;
    });
}
