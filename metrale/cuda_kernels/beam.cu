// Beam search's candidates, one block per running beam: the `count` best (log-probability, id) of the beam's
// logits row after transformers' processors, best first, ties to the lower id. The host adds each beam's running
// score and keeps the best of its beams' candidates (runtime/beam/search.py): the best `count` continuations over
// all of a request's beams are among the best `count` of each beam, so the vocabulary never leaves the device.
//
// As transformers: log_softmax of the raw row in float32 ((x - max) - log_sum, log_sum from a float64 sum), then
// the beam's banned tokens (no_repeat_ngram_size's, and EOS while min_new_tokens is not reached) at -inf. The ban
// is written into the logits row in place, after its log-sum-exp is taken: the row is scratch once read.
#include "sampling_search.cuh"

// logits [N, V] float32 (row stride in elements), overwritten at banned ids. banned_offsets [N + 1] int32: row
// i's banned ids are banned[banned_offsets[i] .. banned_offsets[i + 1]) (ids outside [0, V) are skipped).
// ids_out, values_out [N, count] (count <= SAMPLE_THREADS and <= V): the row's best `count`; a row with NaN or
// no finite maximum gets ids -1 and NaN values.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) beam_candidates(
        float* logits, long long stride, int vocab_size, const int* banned_offsets, const int* banned, int count,
        int* ids_out, float* values_out) {
    wait_for_previous_kernel();
    __shared__ SampleShared sh;
    const int row = blockIdx.x, n = vocab_size;
    float* x = logits + row * stride;
    int* ids = ids_out + row * count;
    float* values = values_out + row * count;

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

    const int first = banned_offsets[row], last = banned_offsets[row + 1];
    if (last > first) {
        for (int j = first + (int)threadIdx.x; j < last; j += blockDim.x) {
            const int id = banned[j];
            if (id >= 0 && id < n) x[id] = -positive_infinity();
        }
        __syncthreads();                        // the bans are visible to the whole block
        thread_max = scan_row(x, n, &sh.stats);  // top_logprobs_of takes its floor from the rows' own maxima
        __syncthreads();
    }
    top_logprobs_of(sh, x, n, keys, thread_max, count, ids, values);
}
