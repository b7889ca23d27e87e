// A beam search step on the device, after beam.cu's beam_state_candidates: select (the search's arithmetic,
// runtime/beam/search.py's BeamGroup.step, for each request), fork (each new running beam's KV blocks from its
// parent's, with the copies that makes), and metadata (the next decode forward's batch, in pack_batch's layout).
// The host only launches them and reads the requests' done flags.
#include "common.cuh"
#include "beam_state.cuh"

#define SELECT_THREADS 256
// A request's candidates (num_beams x keep) and continuations kept (keep), at most: the host checks both.
#define MAX_SELECT 4096
#define MAX_SELECT_KEEP 256
#define MAX_SELECT_BEAMS 32

__device__ __forceinline__ float neg_offset() { return -1.0e9f; }

// v[i]'s place in v[0, n) by value descending, ties to the lower index: torch.topk's order where values differ.
__device__ __forceinline__ int rank_in(const float* v, int n, int i) {
    const float x = v[i];
    int rank = 0;
    for (int j = 0; j < n; ++j) {
        const float y = v[j];
        rank += (y > x) || (y == x && j < i);
    }
    return rank;
}

__device__ __forceinline__ bool is_eos(const BeamState& s, int id) {
    for (int j = 0; j < s.num_eos; ++j)
        if (s.eos[j] == id) return true;
    return false;
}

__device__ __forceinline__ long long half(const BeamState& s, int parity) { return parity * s.total_beams; }

// The search's first candidates, from where the prompt pass left them: cand_ids and cand_values [beams, count]
// (the state's, keep_stride = count) take row rows[b] of ids and values [N, count] (beam.cu's beam_candidates) for
// each beam b. A flat grid, one element per thread. beam_select checks them (a negative id or NaN is a fault).
extern "C" __global__ void beam_seed(int* cand_ids, float* cand_values, const int* ids, const float* values,
                                     const int* rows, int num_beams, int count) {
    wait_for_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_beams * count) return;
    const int beam = i / count;
    const long long from = (long long)rows[beam] * count + (i - beam * count);
    cand_ids[i] = ids[from];
    cand_values[i] = values[from];
}

// One CTA per request of state.active[0, gridDim.x) still searching, `generated` tokens into the search: from
// its beams' candidates and the state at `parity`, the state at 1 - parity and this step's parents; done once
// the search ended (result_parity then says where its hypotheses are).
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) beam_select(const BeamState* state, int parity,
                                                                         int generated) {
    wait_for_previous_kernel();
    const BeamState& s = *state;
    const int r = s.active[blockIdx.x];
    // The request's fields and candidates are read before its done flag is acted on (they are in bounds for an ended
    // request too): their round trips overlap the flag's, which the block then checks after its first pass.
    const int k = s.num_beams[r], base = s.beam_base[r], cur = s.prompt_len[r] + generated;
    const int keep = max(2, 1 + (int)s.num_eos) * k, n = k * keep, next = 1 - parity;
    const long long L = s.max_len;
    const float* running_scores = s.running_scores + half(s, parity) + base;
    float* next_scores = s.running_scores + half(s, next) + base;
    const int* running = s.running + (half(s, parity) + base) * L;
    int* next_running = s.running + (half(s, next) + base) * L;
    const float* divisors = s.divisors + r * s.divisor_stride;

    __shared__ float scores[MAX_SELECT];
    __shared__ int top[MAX_SELECT_KEEP], top_ids[MAX_SELECT_KEEP], top_beams[MAX_SELECT_KEEP];
    __shared__ float top_values[MAX_SELECT_KEEP], running_values[MAX_SELECT_KEEP];
    __shared__ float merged[MAX_SELECT_BEAMS + MAX_SELECT_KEEP];
    __shared__ int chosen[MAX_SELECT_BEAMS], best[MAX_SELECT_BEAMS], stops[MAX_SELECT_KEEP];
    __shared__ int bad, all_stopped;
    if (threadIdx.x == 0) { bad = 0; all_stopped = 1; }
    __syncthreads();

    // Each beam's candidates plus its running score ([beams, keep] flattened, as BeamGroup.step).
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int b = i / keep, j = i % keep;
        const long long at = (long long)(base + b) * s.keep_stride + j;
        const float value = s.cand_values[at];
        if (s.cand_ids[at] < 0 || value != value) bad = 1;
        scores[i] = value + running_scores[b];
    }
    if (s.done[r]) return;                       // the whole block (its request's)
    __syncthreads();
    if (bad) {                                   // nothing to rank: the host ends the call with a device fault
        if (threadIdx.x == 0) {
            *s.fault = 1;
            s.done[r] = 1;
            s.result_parity[r] = parity;
        }
        return;
    }
    if (k == 1) {                                // greedy search: the best token, until EOS or max_length
        const int id = s.cand_ids[(long long)base * s.keep_stride];
        for (int t = threadIdx.x; t < cur; t += blockDim.x) next_running[t] = running[t];
        __syncthreads();
        if (threadIdx.x == 0) {
            next_running[cur] = id;
            next_scores[0] = scores[0];
            s.parents[base] = 0;
            const long long slot = half(s, next) + base;
            s.lengths[slot] = generated + 1;
            s.scores[slot] = scores[0] / divisors[generated + 1];
            s.finished[slot] = s.finished[half(s, parity) + base];
            if (is_eos(s, id) || cur + 1 >= s.max_length[r]) {
                s.done[r] = 1;
                s.result_parity[r] = next;
            }
        }
        __syncthreads();
        int* sequence = s.sequences + (half(s, next) + base) * L;
        for (int t = threadIdx.x; t <= cur; t += blockDim.x) sequence[t] = next_running[t];
        return;
    }

    // The best `keep` continuations over all beams; which of them stop (EOS, or max_length reached).
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int rank = rank_in(scores, n, i);
        if (rank < keep) top[rank] = i;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < keep; t += blockDim.x) {
        const int i = top[t], b = i / keep;
        const int id = s.cand_ids[(long long)(base + b) * s.keep_stride + i % keep];
        const bool stop = is_eos(s, id) || cur + 1 >= s.max_length[r];
        top_beams[t] = b;
        top_ids[t] = id;
        top_values[t] = scores[i];
        stops[t] = stop;
        running_values[t] = scores[i] + (stop ? neg_offset() : -0.0f);
        if (!stop) all_stopped = 0;
    }
    __syncthreads();

    // The next running beams: the best k that did not stop.
    for (int t = threadIdx.x; t < keep; t += blockDim.x) {
        const int rank = rank_in(running_values, keep, t);
        if (rank < k) chosen[rank] = t;
    }
    // Finished hypotheses: the first k continuations that stopped, scored with the length penalty, against the
    // request's finished ones (which come first on ties).
    for (int j = threadIdx.x; j < k + keep; j += blockDim.x) {
        if (j < k) {
            merged[j] = s.scores[half(s, parity) + base + j];
        } else {
            const int t = j - k;
            const bool just_finished = stops[t] && t < k;
            merged[j] = top_values[t] / divisors[generated + 1] + (just_finished ? -0.0f : neg_offset());
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < k + keep; j += blockDim.x) {
        const int rank = rank_in(merged, k + keep, j);
        if (rank < k) best[rank] = j;
    }
    __syncthreads();

    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int t = chosen[j];
        s.parents[base + j] = top_beams[t];
        next_scores[j] = running_values[t];
        const long long slot = half(s, next) + base + j, from = best[j];
        if (from < k) {
            const long long old = half(s, parity) + base + from;
            s.scores[slot] = s.scores[old];
            s.lengths[slot] = s.lengths[old];
            s.finished[slot] = s.finished[old];
        } else {
            const int u = from - k;
            s.scores[slot] = merged[from];
            s.lengths[slot] = generated + 1;
            s.finished[slot] = stops[u] && u < k;
        }
    }
    // Tokens: each new running beam is its parent's plus its token; each finished slot an old one, or a
    // continuation's (its beam's tokens plus its token).
    for (int i = threadIdx.x; i < k * (cur + 1); i += blockDim.x) {
        const int j = i / (cur + 1), p = i % (cur + 1);
        const int t = chosen[j];
        next_running[j * L + p] = p < cur ? running[top_beams[t] * L + p] : top_ids[t];
        const int from = best[j];
        int token;
        if (from < k) {
            token = s.sequences[(half(s, parity) + base + from) * L + p];
        } else {
            const int u = from - k;
            token = p < cur ? running[top_beams[u] * L + p] : top_ids[u];
        }
        s.sequences[(half(s, next) + base + j) * L + p] = token;
    }
    __syncthreads();

    if (threadIdx.x == 0) {
        // transformers' can-improve test: could the best running beam still beat the worst finished one?
        const int steps = generated + 1;
        const int length = s.best_length[r] >= 0 ? s.best_length[r] : steps;
        const float best_running = next_scores[0] / divisors[length];
        const long long first = half(s, next) + base;
        float worst = s.scores[first];
        bool all_finished = true;
        for (int j = 1; j < k; ++j) worst = fminf(worst, s.scores[first + j]);
        bool improvable = false;
        for (int j = 0; j < k; ++j) {
            const bool finished = s.finished[first + j];
            all_finished &= finished;
            improvable |= best_running > (finished ? worst : neg_offset());
        }
        const bool still = s.improvable[r] && improvable;
        s.improvable[r] = still;
        if (!still || (all_finished && s.early_stopping[r] == 1) || all_stopped) {
            s.done[r] = 1;
            s.result_parity[r] = next;
        }
    }
}

// A free block, or -1 when the stack is empty (the top is put back, so later pushes stay in bounds).
__device__ __forceinline__ int pop_block(const BeamState& s) {
    const int top = atomicSub(s.free_top, 1) - 1;
    if (top < 0) {
        atomicAdd(s.free_top, 1);
        return -1;
    }
    const int block = s.free_stack[top];
    s.holders[block] = 1;
    return block;
}

__device__ __forceinline__ void release_block(const BeamState& s, int block) {
    if (--s.holders[block] == 0) s.free_stack[atomicAdd(s.free_top, 1)] = block;
}

// One CTA: for each request of state.active[0, num_active) still searching after beam_select, its new running
// beams' block tables (at 1 - parity) from their parents' (at parity), `generated` tokens into the search (the new
// token's position is prompt_len + generated). As runtime/beam/runner.py's _fork: a parent no child continues
// releases its blocks, one that several continue gains holders; then each child takes a fresh block where its
// token starts one, and where it writes into a partly filled block another beam also holds, a copy of its filled
// slots. All releases happen before any block is taken. Last, every request's done flag and the fault flag
// (done[0, num_requests], the state's fault being done[num_requests]) go to `flags`, pinned host memory the host
// reads after the kernel: no copy between this step's kernels.
//
// A warp per request, a lane per beam (num_beams <= 32), so that a request's holder counts and table copies are
// its lanes' independent loads and atomics rather than one thread's chain of them. Which children copy is as
// _fork's order decides it: a partly filled block is held by the children that point at it (the releases and
// shares leave exactly those holders), and _fork's children, taken in order, copy while another holder remains,
// so every child but the last one pointing at a block copies. Blocks are popped in no fixed order: which
// physical block a beam gets changes no result.
extern "C" __global__ void __launch_bounds__(1024) beam_fork(const BeamState* state, int parity, int generated,
                                                             int num_active, int* flags) {
    wait_for_previous_kernel();
    const BeamState& s = *state;
    const int next = 1 - parity, W = (int)s.table_width, B = (int)s.block_size;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int i = threadIdx.x; i < 3 * s.total_beams; i += blockDim.x) s.copies[i] = 0;
    for (int a = warp; a < num_active; a += warps) {
        const int r = s.active[a];
        if (s.done[r]) continue;                               // the whole warp
        const int k = s.num_beams[r], base = s.beam_base[r], position = s.prompt_len[r] + generated;
        const int filled = (position + B - 1) / B;           // the blocks holding tokens 0 .. position - 1
        const int parent = lane < k ? s.parents[base + lane] : -1;
        int children = 0;                                     // of beam `lane`
        for (int j = 0; j < k; ++j) children += __shfl_sync(0xffffffffu, parent, j) == lane;
        if (lane >= k || children == 1) continue;
        const int* table = s.tables + (half(s, parity) + base + lane) * W;
        for (int e = 0; e < filled; ++e) {
            const int block = table[e];
            if (children == 0) {
                if (atomicSub(s.holders + block, 1) == 1) s.free_stack[atomicAdd(s.free_top, 1)] = block;
            } else {
                atomicAdd(s.holders + block, children - 1);
            }
        }
    }
    __syncthreads();
    for (int a = warp; a < num_active; a += warps) {
        const int r = s.active[a];
        if (s.done[r]) continue;
        const int k = s.num_beams[r], base = s.beam_base[r], position = s.prompt_len[r] + generated;
        const int filled = (position + B - 1) / B, index = position / B, offset = position % B;
        const int j = lane;
        int last = -1;                                        // the partly filled block child j writes into
        if (j < k) {
            const int* from = s.tables + (half(s, parity) + base + s.parents[base + j]) * W;
            int* table = s.tables + (half(s, next) + base + j) * W;
            for (int e = 0; e < filled; ++e) table[e] = from[e];
            if (offset != 0) last = from[index];
        }
        bool later = false;                                   // a later child points at the same block
        for (int other = 0; other < k; ++other) {
            const int theirs = __shfl_sync(0xffffffffu, last, other);      // every lane takes part
            later |= other > j && theirs == last;
        }
        if (j >= k) continue;
        const bool needs_block = offset == 0 || later;
        const int own = needs_block ? pop_block(s) : 0;
        if (own < 0) {          // the reservation ran dry (it is sized so it cannot): the request writes nothing more
            *s.fault = 1;
            s.done[r] = 1;
            s.result_parity[r] = next;
            continue;
        }
        int* table = s.tables + (half(s, next) + base + j) * W;
        if (offset == 0) {
            table[index] = own;
        } else if (needs_block) {
            atomicSub(s.holders + last, 1);
            table[index] = own;
            int* copy = s.copies + 3 * (base + j);
            copy[0] = s.block_ids[last];
            copy[1] = s.block_ids[own];
            copy[2] = offset;
        }
    }
    __syncthreads();
    for (int r = threadIdx.x; r <= (int)s.num_requests; r += blockDim.x) flags[r] = s.done[r];
    __threadfence_system();
}

// One CTA per row of the next decode forward (`rows` padded to its graph's size): row i < num_rows is beam
// state.rows_beam[i], whose newest token (`generated` tokens into the search) it feeds at its position, writing
// its K/V into its block table's slot; padding rows and rows of ended searches read and write nothing (context 0,
// slot -1). The outputs are pack_batch's arrays for a pure decode batch, and an encoder-decoder's cross batch
// (the same rows over their sources' blocks) where cross_tables is given. The CTA's threads write the row's table
// entries side by side; its first thread the row's scalars.
extern "C" __global__ void beam_metadata(const BeamState* state, int parity, int generated, int num_rows, int rows,
                                         int* token_ids, int* positions, int* slots, int* sample_rows,
                                         int* decode_rows, int* contexts, int* tables,
                                         int* cross_token_ids, int* cross_positions, int* cross_slots,
                                         int* cross_sample_rows, int* cross_decode_rows, int* cross_contexts,
                                         int* cross_tables) {
    wait_for_previous_kernel();
    const BeamState& s = *state;
    const int i = blockIdx.x;
    const int M = (int)s.max_blocks, B = (int)s.block_size;
    int token = 0, position = 0, slot = -1, context = 0, used = 0, source = 0, source_blocks = 0, r = -1;
    const int* table = nullptr;
    if (i < num_rows) {
        const int beam = s.rows_beam[i];
        r = s.beam_request[beam];
        if (!s.done[r]) {
            position = s.prompt_len[r] + generated - 1;
            table = s.tables + (half(s, parity) + beam) * s.table_width;
            context = position + 1;
            used = (context + B - 1) / B;
            source = s.source_len[r];
            source_blocks = (source + B - 1) / B;
            if (threadIdx.x == 0) {
                token = s.running[(half(s, parity) + beam) * s.max_len + position];
                slot = s.block_ids[table[position / B]] * B + position % B;
            }
        }
    }
    for (int e = threadIdx.x; e < M; e += blockDim.x) {
        tables[(long long)i * M + e] = e < used ? s.block_ids[table[e]] : 0;
        if (cross_tables != nullptr)
            cross_tables[(long long)i * M + e] = e < source_blocks ? s.cross_tables[(long long)r * M + e] : 0;
    }
    if (threadIdx.x != 0) return;
    token_ids[i] = token;
    positions[i] = position;
    slots[i] = slot;
    sample_rows[i] = i;
    decode_rows[i] = i;
    contexts[i] = context;
    if (cross_token_ids == nullptr) return;
    cross_token_ids[i] = token;
    cross_positions[i] = position;
    cross_slots[i] = -1;
    cross_sample_rows[i] = i;
    cross_decode_rows[i] = i;
    cross_contexts[i] = source;
}
