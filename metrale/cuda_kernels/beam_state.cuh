// A BeamGenerate call's search state on the device (beam_step.cu, beam.cu's beam_state_candidates): every array
// the host's BeamGroup and block bookkeeping hold, for the call's requests (R), their beams (TB, request r's at
// beam_base[r] .. + num_beams[r]) and its reserved KV blocks. Arrays marked [2, ...] are double-buffered: a step
// reads the half at `parity` and writes the other, since beams continue other beams.
//
// The host writes this struct once per call (runtime/backend/cuda/beam_search.py, SIZES then ARRAYS: the same fields
// in the same order, each 8 bytes).
#pragma once

struct BeamState {
    // Sizes.
    long long num_requests, total_beams, max_len, table_width, keep_stride, num_eos, block_size, max_blocks;
    long long divisor_stride;
    // Per request [R].
    int* num_beams;
    int* beam_base;
    int* prompt_len;       // tokens before the first searched one
    int* max_length;       // prompt_len + max_new_tokens
    int* min_new;
    int* ngram;            // no_repeat_ngram_size
    int* early_stopping;   // 0 false, 1 true, 2 never
    int* best_length;      // the can-improve test's length: max_new_tokens for NEVER with length_penalty > 0, else -1
    int* source_len;       // encoder-decoders: the source's cross-attention keys
    int* cross_tables;     // [R, max_blocks] the source's cross blocks (pool ids)
    float* divisors;       // [R, divisor_stride] float32(length ** length_penalty), by length
    int* eos;              // [num_eos]
    int* done;             // the request's search ended
    int* improvable;
    int* result_parity;    // where its finished hypotheses are, once done
    int* fault;            // [1]: a logits row had no finite maximum, or the blocks ran out
    // Per beam [TB].
    int* beam_request;
    int* running;          // [2, TB, max_len] tokens
    float* running_scores; // [2, TB]
    int* tables;           // [2, TB, table_width] indices into block_ids
    int* sequences;        // [2, TB, max_len] the finished hypotheses' tokens: request r's num_beams slots
    float* scores;         // [2, TB]
    int* lengths;          // [2, TB] generated tokens
    int* finished;         // [2, TB]
    int* parents;          // [TB] this step's: the request's beam each new running beam continues
    int* cand_ids;         // [TB, keep_stride] each beam's best continuations (beam.cu)
    float* cand_values;
    int* copies;           // [TB, 3] this step's KV prefix copies (pool ids; slots 0: none)
    // The call's reserved blocks [B]: pool ids, holders, and a stack of the free ones.
    int* block_ids;
    int* holders;
    int* free_stack;
    int* free_top;         // [1]
    // The forward's rows, written by the host when requests leave: row -> beam, and the searching requests.
    int* rows_beam;
    int* active;
};
