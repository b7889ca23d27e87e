// A mixture-of-experts layer's routing on the device, in one launch with no host round trip (moe_route): each
// token's chosen experts and weights from its router logits, then the chosen (token, expert) entries grouped by
// expert for the grouped GEMMs of moe.cu. The grid is sized by the batch's row count alone, so a decode step's launch
// is the same in every replay of its CUDA graph.
//
// Entry i = t * top_k + j is token t's j-th chosen expert. Sorted by expert, entry sorted_entries[r] sits at row r,
// expert e's rows being offsets[e] .. offsets[e + 1] - 1; positions[i] is entry i's row.
#include "common.cuh"

#define MOE_MAX_EXPERTS 512     // experts a router scores (a warp's lanes hold 16 each)
#define MOE_MAX_TOP_K 16

namespace {

__device__ __forceinline__ float moe_minus_infinity() { return __int_as_float(0xff800000); }

// The better of two (value, expert) candidates: the higher value, the lower expert on a tie (torch.topk's on CUDA);
// NaN above every number, as torch.topk ranks it (so a token with a NaN logit still chooses real experts).
__device__ __forceinline__ bool moe_better(float value, int expert, float other_value, int other_expert) {
    const bool nan = value != value, other_nan = other_value != other_value;
    if (nan != other_nan) return nan;
    if (nan) return expert < other_expert;
    return value > other_value || (value == other_value && expert < other_expert);
}

// The warp's best candidate: every lane gets it.
__device__ __forceinline__ void moe_warp_best(float& value, int& expert) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, value, offset);
        const int e = __shfl_xor_sync(0xffffffffu, expert, offset);
        if (moe_better(v, e, value, expert)) { value = v; expert = e; }
    }
}

}  // namespace

namespace {

constexpr int ROUTE_THREADS = 256;                  // 8 tokens a block
constexpr int GROUP_LOADS = 8;

// visit(i, ids[i]) for every entry, by one block. A prefill's tens of thousands of entries: each thread's
// GROUP_LOADS ids are loaded before any is visited, so the loads' latency is paid once a group, not once an entry.
template <typename Visit>
__device__ __forceinline__ void for_each_entry(const int* ids, int entries, Visit visit) {
    for (int first = 0; first < entries; first += GROUP_LOADS * blockDim.x) {
        int expert[GROUP_LOADS];
#pragma unroll
        for (int u = 0; u < GROUP_LOADS; ++u) {
            const int i = first + u * blockDim.x + threadIdx.x;
            expert[u] = i < entries ? __ldcg(ids + i) : -1;
        }
#pragma unroll
        for (int u = 0; u < GROUP_LOADS; ++u)
            if (expert[u] >= 0) visit(first + u * blockDim.x + threadIdx.x, expert[u]);
    }
}

// The entries' grouping by expert, by one block (after every token's ids are written): counts -> offsets [E + 1];
// each entry's row (positions) and each row's entry (sorted_entries; rows of one expert in no set order: each row's
// product is its own); and the grouped GEMM's tiles, (expert, first row) of every tile_rows rows of each expert's,
// into tiles [max_tiles, 2], their number into tile_count[0].
__device__ void moe_group_entries(const int* ids, int entries, int num_experts, int tile_rows, int max_tiles,
                                  int* offsets, int* sorted_entries, int* positions, int* tiles, int* tile_count) {
    __shared__ int count[MOE_MAX_EXPERTS], cursor[MOE_MAX_EXPERTS], first_tile[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for_each_entry(ids, entries, [&](int, int expert) { atomicAdd(&count[expert], 1); });
    __syncthreads();
    if (threadIdx.x < 32) {             // one warp scans rows and tiles: lane l owns experts l * per .. + per - 1
        const int lane = threadIdx.x, per = (num_experts + 31) / 32, first = lane * per;
        const int last = min(first + per, num_experts);
        int rows = 0, tile_sum = 0;
        for (int e = first; e < last; ++e) {
            rows += count[e];
            tile_sum += (count[e] + tile_rows - 1) / tile_rows;
        }
        int row = rows, tile = tile_sum;                       // inclusive scans over the lanes
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int r = __shfl_up_sync(0xffffffffu, row, offset), t = __shfl_up_sync(0xffffffffu, tile, offset);
            if (lane >= offset) { row += r; tile += t; }
        }
        if (lane == 31) {
            offsets[num_experts] = row;
            tile_count[0] = min(tile, max_tiles);
        }
        row -= rows;
        tile -= tile_sum;
        for (int e = first; e < last; ++e) {
            cursor[e] = offsets[e] = row;
            first_tile[e] = tile;
            row += count[e];
            tile += (count[e] + tile_rows - 1) / tile_rows;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        for (int t = 0, tile = first_tile[e]; t * tile_rows < count[e] && tile < max_tiles; ++t, ++tile) {
            tiles[2 * tile] = e;
            tiles[2 * tile + 1] = cursor[e] + t * tile_rows;
        }
    }
    __syncthreads();
    for_each_entry(ids, entries, [&](int i, int expert) {
        const int row = atomicAdd(&cursor[expert], 1);
        sorted_entries[row] = i;
        positions[i] = row;
    });
}

// One token's choice (moe_route's), by one warp; each lane holds PER experts (lane, lane + 32, ...), PER * 32 >= E.
template <int PER>
__device__ __forceinline__ void route_token(const float* row, int num_experts, int top_k, int scoring,
                                            int round_logits, int normalize, const float* correction_bias,
                                            int n_group, int topk_group, int group_best_two, float scaling, int* ids,
                                            float* weights, int lane) {
    float score[PER], choice[PER];
    float largest = moe_minus_infinity();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        float logit = e < num_experts ? row[e] : moe_minus_infinity();
        if (round_logits && e < num_experts) logit = bf16_to_float(float_to_bf16(logit));
        score[i] = logit;
        largest = fmaxf(largest, logit);
    }
    if (scoring == 0) {
        largest = warp_max(largest);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            score[i] = lane + 32 * i < num_experts ? expf(score[i] - largest) : 0.f;
            sum += score[i];
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int i = 0; i < PER; ++i) score[i] /= sum;
    } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) score[i] = 1.f / (1.f + expf(-score[i]));
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        choice[i] = e >= num_experts ? moe_minus_infinity()
                  : correction_bias != nullptr ? score[i] + correction_bias[e] : score[i];
    }
    if (n_group > 1) {
        // Each group's two best choice values, summed (or its best alone); then the topk_group best groups (lower
        // group on a tie).
        const int group_size = num_experts / n_group;
        unsigned long long kept = 0;                          // a bit per group (n_group <= 64)
        float group_score = moe_minus_infinity();                        // lane g holds group g's
        for (int g = 0; g < n_group; ++g) {
            float first = moe_minus_infinity(), second = moe_minus_infinity();
            int first_expert = num_experts, second_expert = num_experts;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int e = lane + 32 * i;
                if (e / group_size != g || e >= num_experts) continue;
                if (moe_better(choice[i], e, first, first_expert)) {
                    second = first; second_expert = first_expert; first = choice[i]; first_expert = e;
                } else if (moe_better(choice[i], e, second, second_expert)) {
                    second = choice[i]; second_expert = e;
                }
            }
            float best = first;
            int best_expert = first_expert;
            moe_warp_best(best, best_expert);                 // the group's best, then the best of the others
            float runner_up = first_expert == best_expert ? second : first;
            int runner_up_expert = first_expert == best_expert ? second_expert : first_expert;
            moe_warp_best(runner_up, runner_up_expert);
            if (lane == g) group_score = group_best_two ? best + runner_up : best;
        }
        for (int pick = 0; pick < topk_group; ++pick) {
            float value = (lane < n_group && !((kept >> lane) & 1ull)) ? group_score : moe_minus_infinity();
            int group = lane < n_group ? lane : 64;
            moe_warp_best(value, group);
            kept |= 1ull << group;
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = lane + 32 * i;
            if (e < num_experts && !((kept >> (e / group_size)) & 1ull)) choice[i] = moe_minus_infinity();
        }
    }
    // top_k rounds of the warp's best choice; its score is the weight. Lane j keeps the j-th.
    float my_weight = 0.f, total = 0.f;
    int my_expert = 0;
    for (int j = 0; j < top_k; ++j) {
        float value = moe_minus_infinity();
        int expert = MOE_MAX_EXPERTS, slot = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = lane + 32 * i;
            if (e < num_experts && choice[i] != moe_minus_infinity() && moe_better(choice[i], e, value, expert)) {
                value = choice[i]; expert = e; slot = i;
            }
        }
        const int mine = expert;
        moe_warp_best(value, expert);
        float chosen = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (mine == expert && slot == i) { chosen = score[i]; choice[i] = moe_minus_infinity(); }
        chosen = __shfl_sync(0xffffffffu, chosen, expert & 31);
        total += chosen;
        if (lane == j) { my_weight = chosen; my_expert = expert; }
    }
    if (lane < top_k) {
        const float divisor = normalize ? total + (scoring == 1 ? 1e-20f : 0.f) : 1.f;
        ids[lane] = min(my_expert, num_experts - 1);                            // never past the experts
        weights[lane] = my_weight / divisor * scaling;
    }
}

}  // namespace

// The router's choice and the grouping of its entries, in one launch. One warp per token: logits [T, E] float32,
// row stride logits_stride. scoring 0: softmax over the experts (each logit first rounded to bf16 where
// round_logits: transformers' softmax routers take the logits in the model's dtype); 1: sigmoid of each. The choice
// adds correction_bias (float32 [E], or null) to the scores; with n_group > 1 only the topk_group groups (of
// E / n_group consecutive experts) whose two best choice values sum highest (group_best_two; else whose best is
// highest, DeepSeek-V2) take part. The top_k choices go to ids
// [T, top_k] (best first) and their scores, divided by their sum where normalize (+ 1e-20 for sigmoid scores, as
// DeepSeek-V3), times scaling, to weights [T, top_k]. The last block to finish (done counts them; it is 0 before a
// launch and after) groups the entries (moe_group_entries); a grid of one block groups them after a barrier. Block:
// ROUTE_THREADS.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
moe_route(const float* logits, int logits_stride, int num_tokens, int num_experts, int top_k, int scoring,
          int round_logits, int normalize, const float* correction_bias, int n_group, int topk_group,
          int group_best_two, float scaling, int* ids, float* weights, int tile_rows, int max_tiles, int* offsets,
          int* sorted_entries, int* positions, int* tiles, int* tile_count, unsigned* done) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31, token = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (token < num_tokens) {
        const float* row = logits + (long long)token * logits_stride;
        int* token_ids = ids + (long long)token * top_k;
        float* token_weights = weights + (long long)token * top_k;
        if (num_experts <= 128)         // fewer experts a lane: the top-k rounds are a chain of dependent steps
            route_token<4>(row, num_experts, top_k, scoring, round_logits, normalize, correction_bias, n_group,
                           topk_group, group_best_two, scaling, token_ids, token_weights, lane);
        else if (num_experts <= 256)
            route_token<8>(row, num_experts, top_k, scoring, round_logits, normalize, correction_bias, n_group,
                           topk_group, group_best_two, scaling, token_ids, token_weights, lane);
        else
            route_token<MOE_MAX_EXPERTS / 32>(row, num_experts, top_k, scoring, round_logits, normalize,
                                              correction_bias, n_group, topk_group, group_best_two, scaling,
                                              token_ids, token_weights, lane);
    }
    if (gridDim.x > 1) {
        __shared__ bool last;
        __threadfence();                // this block's ids before its count
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
    } else {                            // a decode's few tokens: the block's own ids, no count to wait on
        __syncthreads();
    }
    moe_group_entries(ids, num_tokens * top_k, num_experts, tile_rows, max_tiles, offsets, sorted_entries, positions,
                      tiles, tile_count);
    if (threadIdx.x == 0) *done = 0u;
}
