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
#include "sampling_search.cuh"

#define WIDEN_THREADS 256

// The LM head's bf16 logits as float32 rows, as transformers' `logits.to(float32)` before its processors: the rows
// the kernels below read. logits [N, >= V] bf16 and out [N, >= V] float32, row strides in elements; grid (N, any).
extern "C" __global__ void __launch_bounds__(WIDEN_THREADS) widen_rows(
        float* out, long long out_stride, const bf16* logits, long long stride, int vocab_size) {
    wait_for_previous_kernel();
    const bf16* x = logits + blockIdx.x * stride;
    float* y = out + blockIdx.x * out_stride;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < vocab_size; i += gridDim.y * blockDim.x) {
        y[i] = bf16_to_float(x[i]);
    }
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
