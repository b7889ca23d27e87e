// A mixture-of-experts layer on the device, with no host round trip: the router's choice and the chosen (token,
// expert) entries grouped by expert (moe_route, one launch), the experts' projections as one grouped GEMM launch each
// over those groups (moe_grouped_gemm), and each token's weighted sum of its experts' outputs (moe_combine).
// Every grid is sized by the batch's row count alone, so a decode step's launches are the same in every replay of
// its CUDA graph; blocks past the work the device found exit at once.
//
// Entry i = t * top_k + j is token t's j-th chosen expert. Sorted by expert, entry sorted_entries[r] sits at row r,
// expert e's rows being offsets[e] .. offsets[e + 1] - 1; positions[i] is entry i's row.
#include "skinny_gemm.cuh"

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
                                            int n_group, int topk_group, float scaling, int* ids, float* weights,
                                            int lane) {
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
        // Each group's two best choice values, summed; then the topk_group best groups (lower group on a tie).
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
            if (lane == g) group_score = best + runner_up;
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
// E / n_group consecutive experts) whose two best choice values sum highest take part. The top_k choices go to ids
// [T, top_k] (best first) and their scores, divided by their sum where normalize (+ 1e-20 for sigmoid scores, as
// DeepSeek-V3), times scaling, to weights [T, top_k]. The last block to finish (done counts them; it is 0 before a
// launch and after) groups the entries (moe_group_entries). Block: ROUTE_THREADS.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
moe_route(const float* logits, int logits_stride, int num_tokens, int num_experts, int top_k, int scoring,
          int round_logits, int normalize, const float* correction_bias, int n_group, int topk_group, float scaling,
          int* ids, float* weights, int tile_rows, int max_tiles, int* offsets, int* sorted_entries, int* positions,
          int* tiles, int* tile_count, unsigned* done) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31, token = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (token < num_tokens) {
        const float* row = logits + (long long)token * logits_stride;
        int* token_ids = ids + (long long)token * top_k;
        float* token_weights = weights + (long long)token * top_k;
        if (num_experts <= 128)         // fewer experts a lane: the top-k rounds are a chain of dependent steps
            route_token<4>(row, num_experts, top_k, scoring, round_logits, normalize, correction_bias, n_group,
                           topk_group, scaling, token_ids, token_weights, lane);
        else if (num_experts <= 256)
            route_token<8>(row, num_experts, top_k, scoring, round_logits, normalize, correction_bias, n_group,
                           topk_group, scaling, token_ids, token_weights, lane);
        else
            route_token<MOE_MAX_EXPERTS / 32>(row, num_experts, top_k, scoring, round_logits, normalize,
                                              correction_bias, n_group, topk_group, scaling, token_ids,
                                              token_weights, lane);
    }
    __shared__ bool last;
    __threadfence();                    // this block's ids before its count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    moe_group_entries(ids, num_tokens * top_k, num_experts, tile_rows, max_tiles, offsets, sorted_entries, positions,
                      tiles, tile_count);
    if (threadIdx.x == 0) *done = 0u;
}

// The grouped GEMMs: for each tile (expert e, first row r0) of tile_count[0], rows r0 .. min(r0 + tile rows,
// offsets[e + 1]) - 1 of out [rows, N] = a(row) [K] @ weight[e] [N, K]^T, where a(row) is row sorted_entries[row] /
// gather_div of a [*, K] (gather_div > 0: a token's x for each of its entries) or row `row` of a (gather_div 0:
// the rows already in sorted order). bf16 in, fp32 accumulate on tensor cores (mma.sync m16n8k16), bf16 out.
// K % 8 == 0; a and weight 16-byte aligned (rows too).
//
// Decode (tiles of 8 or 16 rows): skinny_gemm.cuh's kernel over a tile's gathered rows, each CTA 16 rows of its
// expert's weight read once. Grid: (ceil(N / 16), max_tiles); block: 256 threads.
namespace {

// A tile's rows of a, as skinny_gemm reads them (16-byte chunks; stride in chunks).
struct TileRows {
    const uint4* a;
    long long stride;
    const int* sorted_entries;
    int gather_div, row0;
    __device__ __forceinline__ const uint4* operator()(int t) const {
        const int row = row0 + t;
        return a + (long long)(gather_div ? sorted_entries[row] / gather_div : row) * stride;
    }
};

template <int TOKEN_TILES>
__device__ __forceinline__ void grouped_skinny(bf16* out, const uint4* a, long long a_stride, const uint4* weight,
                                               const int* sorted_entries, int gather_div, const int* offsets,
                                               const int* tiles, const int* tile_count, int n, int k_chunks) {
    const int tile = blockIdx.y;
    if (tile >= tile_count[0]) return;
    const int expert = tiles[2 * tile], row0 = tiles[2 * tile + 1];
    const int rows = min(8 * TOKEN_TILES, offsets[expert + 1] - row0);
    skinny_gemm<TOKEN_TILES>(out + (long long)row0 * n, (long long)n,
                             TileRows{a, a_stride, sorted_entries, gather_div, row0},
                             weight + (long long)expert * n * k_chunks, static_cast<const bf16*>(nullptr), rows, n,
                             k_chunks, 0);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M8)
moe_skinny_gemm_m8(bf16* out, const uint4* a, long long a_stride, const uint4* weight, const int* sorted_entries,
                   int gather_div, const int* offsets, const int* tiles, const int* tile_count, int n, int k_chunks) {
    wait_for_previous_kernel();
    grouped_skinny<1>(out, a, a_stride, weight, sorted_entries, gather_div, offsets, tiles, tile_count, n, k_chunks);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M16)
moe_skinny_gemm_m16(bf16* out, const uint4* a, long long a_stride, const uint4* weight, const int* sorted_entries,
                    int gather_div, const int* offsets, const int* tiles, const int* tile_count, int n, int k_chunks) {
    wait_for_previous_kernel();
    grouped_skinny<2>(out, a, a_stride, weight, sorted_entries, gather_div, offsets, tiles, tile_count, n, k_chunks);
}

// Prefill (tiles of 64 or 128 rows): a CTA of WARPS warps owns BN = 128 columns of a tile, over BK = 32 of K at a
// time in a STAGES-deep cp.async ring (48 KB of static shared memory). Warps split the tile into 64-row slices
// (BM / 64 of them) and the columns among the rest (4 warps at BM 128: 64 x 64 each; at BM 64: 64 x 32 each); fragments come from shared memory by ldmatrix.x4. A tile row is 64 bytes (four
// 16-byte chunks); chunk c of row r sits at chunk c ^ ((r >> 1) & 3), so that the 8 rows an ldmatrix matrix reads
// fall in 8 different bank groups. Each thread gathers its rows' addresses of a once, before the K loop.
// Grid: (ceil(N / BN), max_tiles); block: 32 * WARPS threads.
namespace {

constexpr int BN = 128, BK = 32, ROW_CHUNKS = BK / 8;
constexpr int GEMM_SHARED_BYTES = 48 * 1024;

template <int BM, int WARPS>
struct GroupedGemm {
    static constexpr int THREADS = 32 * WARPS, WARPS_M = BM / 64, WARPS_N = WARPS / WARPS_M;
    static constexpr int WARP_N = BN / WARPS_N, N_TILES = WARP_N / 8;          // 8-column mma tiles of a warp
    static constexpr int STAGE_CHUNKS = (BM + BN) * ROW_CHUNKS;                // 16-byte chunks a stage
    static constexpr int STAGES = GEMM_SHARED_BYTES / (16 * STAGE_CHUNKS);      // 4 (BM 64) or 3 (BM 128)
    static constexpr int A_LOADS = BM * ROW_CHUNKS / THREADS;                   // chunks a thread copies a stage
    static constexpr int W_LOADS = BN * ROW_CHUNKS / THREADS;
    static constexpr int ROW_STEP = THREADS / ROW_CHUNKS;                       // rows between a thread's copies
    static_assert(BM == 64 || BM == 128, "tiles of 64 or 128 rows");
};

__device__ __forceinline__ int swizzled(int row, int chunk) { return row * ROW_CHUNKS + (chunk ^ ((row >> 1) & 3)); }

template <int BM, int WARPS>
__device__ __forceinline__ void grouped_gemm(bf16* out, const bf16* a, long long a_stride, const bf16* weight,
                                             const int* sorted_entries, int gather_div, const int* offsets,
                                             const int* tiles, const int* tile_count, int n, int k) {
    using G = GroupedGemm<BM, WARPS>;
    const int tile = blockIdx.y;
    if (tile >= tile_count[0]) return;
    const int expert = tiles[2 * tile], row0 = tiles[2 * tile + 1];
    const int rows = min(BM, offsets[expert + 1] - row0), col0 = blockIdx.x * BN;
    const bf16* w = weight + (long long)expert * n * k;
    __shared__ __align__(128) uint4 ring[G::STAGES][G::STAGE_CHUNKS];     // a stage: BM a rows, then BN w rows
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp_row = (warp / G::WARPS_N) * 64, warp_col = (warp % G::WARPS_N) * G::WARP_N;
    const int chunk = threadIdx.x % ROW_CHUNKS;          // the 16-byte chunk of BK this thread copies, every row

    // Row r of a stage's copies: a's rows threadIdx.x / 4 + ROW_STEP i; w's the same of the BN weight rows.
    const bf16* a_rows[G::A_LOADS];
    bool a_valid[G::A_LOADS];
#pragma unroll
    for (int i = 0; i < G::A_LOADS; ++i) {
        const int r = threadIdx.x / ROW_CHUNKS + G::ROW_STEP * i;
        a_valid[i] = r < rows;
        const int source = !a_valid[i] ? 0 : gather_div ? sorted_entries[row0 + r] / gather_div : row0 + r;
        a_rows[i] = a + (long long)source * a_stride + chunk * 8;
    }
    auto load = [&](int stage, int k0) {
        const bool k_valid = k0 + chunk * 8 < k;
        uint4* s = ring[stage];
#pragma unroll
        for (int i = 0; i < G::A_LOADS; ++i) {
            const int r = threadIdx.x / ROW_CHUNKS + G::ROW_STEP * i;
            const bool valid = a_valid[i] && k_valid;
            copy_async_16(s + swizzled(r, chunk), valid ? a_rows[i] + k0 : a, valid);
        }
#pragma unroll
        for (int i = 0; i < G::W_LOADS; ++i) {
            const int r = threadIdx.x / ROW_CHUNKS + G::ROW_STEP * i;
            const bool valid = col0 + r < n && k_valid;
            copy_async_16(s + BM * ROW_CHUNKS + swizzled(r, chunk),
                          valid ? w + (long long)(col0 + r) * k + k0 + chunk * 8 : w, valid);
        }
    };

    float acc[4][G::N_TILES][4] = {};
    const int steps = (k + BK - 1) / BK;
#pragma unroll
    for (int stage = 0; stage < G::STAGES - 1; ++stage) {
        if (stage < steps) load(stage, stage * BK);
        copy_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        copy_async_wait<G::STAGES - 2>();     // this step's stage has landed (for this thread's copies) ...
        __syncthreads();                       // ... and everyone's; the stage refilled below is consumed by all
        const int next = step + G::STAGES - 1;
        if (next < steps) load(next % G::STAGES, next * BK);
        copy_async_commit();
        const uint4* s = ring[step % G::STAGES];
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // A, matrices (rows +0, k +0), (+8, +0), (+0, +8), (+8, +8): lane l gives row l & 15, chunk 2kk + l / 16.
            unsigned frag[4][4];
#pragma unroll
            for (int m = 0; m < 4; ++m)
                ldmatrix_x4(frag[m], s + swizzled(warp_row + 16 * m + (lane & 15), 2 * kk + (lane >> 4)));
            // W, two 8-column tiles an ldmatrix: matrices (cols +0, k +0), (+0, +8), (+8, +0), (+8, +8).
#pragma unroll
            for (int j = 0; j < G::N_TILES; j += 2) {
                unsigned b[4];
                ldmatrix_x4(b, s + BM * ROW_CHUNKS +
                                   swizzled(warp_col + 8 * j + (lane & 7) + ((lane >> 4) << 3),
                                            2 * kk + ((lane >> 3) & 1)));
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    mma_bf16(acc[m][j], frag[m], b[0], b[1]);
                    mma_bf16(acc[m][j + 1], frag[m], b[2], b[3]);
                }
            }
        }
    }
    copy_async_wait<0>();
    // acc[m][j]: rows warp_row + 16 m + (g, g + 8), columns warp_col + 8 j + (2t, 2t + 1).
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int j = 0; j < G::N_TILES; ++j) {
            const int col = col0 + warp_col + 8 * j + 2 * t;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = warp_row + 16 * m + g + 8 * half;
                if (r >= rows) continue;
                bf16* dst = out + (long long)(row0 + r) * n + col;
                if (col + 1 < n)
                    *reinterpret_cast<unsigned*>(dst) = float2_to_bf16x2(acc[m][j][2 * half], acc[m][j][2 * half + 1]);
                else if (col < n)
                    *dst = float_to_bf16(acc[m][j][2 * half]);
            }
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128)
moe_grouped_gemm_m64(bf16* out, const bf16* a, long long a_stride, const bf16* weight, const int* sorted_entries,
                     int gather_div, const int* offsets, const int* tiles, const int* tile_count, int n, int k) {
    wait_for_previous_kernel();
    grouped_gemm<64, 4>(out, a, a_stride, weight, sorted_entries, gather_div, offsets, tiles, tile_count, n, k);
}

extern "C" __global__ void __launch_bounds__(128)
moe_grouped_gemm_m128(bf16* out, const bf16* a, long long a_stride, const bf16* weight, const int* sorted_entries,
                      int gather_div, const int* offsets, const int* tiles, const int* tile_count, int n, int k) {
    wait_for_previous_kernel();
    grouped_gemm<128, 4>(out, a, a_stride, weight, sorted_entries, gather_div, offsets, tiles, tile_count, n, k);
}

// out [T, H] = bf16(sum over j of weights[t, j] * expert_out[positions[t * top_k + j]] (+ shared[t], where given)),
// in fp32. Grid: (ceil(H / (2 * blockDim.x)), T); each thread two columns.
extern "C" __global__ void moe_combine(bf16* out, const bf16* expert_out, const float* weights,
                                       const int* positions, const bf16* shared, int hidden, int top_k) {
    wait_for_previous_kernel();
    const int token = blockIdx.y, col = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (col >= hidden) return;
    float x = 0.f, y = 0.f;
    for (int j = 0; j < top_k; ++j) {
        const int entry = token * top_k + j;
        const float w = weights[entry];
        const float2 v = bf16x2_to_float2(
            *reinterpret_cast<const unsigned*>(expert_out + (long long)positions[entry] * hidden + col));
        x += w * v.x;
        y += w * v.y;
    }
    if (shared != nullptr) {
        const float2 v = bf16x2_to_float2(*reinterpret_cast<const unsigned*>(shared + (long long)token * hidden + col));
        x += v.x;
        y += v.y;
    }
    *reinterpret_cast<unsigned*>(out + (long long)token * hidden + col) = float2_to_bf16x2(x, y);
}
