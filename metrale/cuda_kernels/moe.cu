// A mixture-of-experts layer's experts on the device, over moe_route.cu's grouping (no host round trip): the experts'
// projections as one grouped GEMM launch each over the groups of entries (moe_grouped_gemm, moe_skinny_gemm), and
// each token's weighted sum of its experts' outputs (moe_combine). Every grid is sized by the batch's row count alone,
// so a decode step's launches are the same in every replay of its CUDA graph; blocks past the work the device found
// exit at once. Entries, rows, offsets and positions as in moe_route.cu.
#include "skinny_gemm.cuh"

// The grouped GEMMs: for each tile (expert e, first row r0) of tile_count[0], rows r0 .. min(r0 + tile rows,
// offsets[e + 1]) - 1 of out [rows, N] = a(row) [K] @ weight[e] [N, K]^T, where a(row) is row sorted_entries[row] /
// gather_div of a [*, K] (gather_div > 0: a token's x for each of its entries) or row `row` of a (gather_div 0:
// the rows already in sorted order). bf16 in, fp32 accumulate on tensor cores (mma.sync m16n8k16), bf16 out.
// K % 8 == 0; a and weight 16-byte aligned (rows too). gated: weight[e] is a gated MLP's gate and up rows interleaved
// by 8 (rows 16 q + i, 16 q + 8 + i are the gate's and the up's row 8 q + i; N % 16 == 0), and out [rows, N / 2] =
// silu(gate) * up (common.cuh's silu_mul_of_rounded, clamped where limit > 0: Hy4's swiglu_limit): the activation in
// the GEMM's epilogue, no launch of its own.
//
// Decode (tiles of 8 rows, while the entries average a few an expert): skinny_gemm.cuh's kernel over a tile's gathered
// rows, each CTA 16 rows of its expert's weight read once. Grid: (ceil(N / 16), max_tiles); block: 256 threads.
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

// expert(w, e): expert e's weights in w's form (an expert's n rows one after another's).
__device__ __forceinline__ Bf16Weights expert_weights(const uint4* weight, const float*, int expert, int n,
                                                      int k_chunks, Bf16Weights) {
    return Bf16Weights{weight + (long long)expert * n * k_chunks};
}
__device__ __forceinline__ Fp8RowWeights expert_weights(const uint4* weight, const float* scales, int expert, int n,
                                                        int k_chunks, Fp8RowWeights) {
    return Fp8RowWeights{weight + (long long)expert * n * (k_chunks / Fp8RowWeights::CHUNKS),
                         scales + (long long)expert * n};
}
// In blocks: an expert's scales [K / 128, N] (16 chunks a block), after the experts before it.
__device__ __forceinline__ Fp8BlockWeights expert_weights(const uint4* weight, const float* scales, int expert, int n,
                                                          int k_chunks, Fp8BlockWeights) {
    return Fp8BlockWeights{{weight + (long long)expert * n * (k_chunks / Fp8RowWeights::CHUNKS),
                            scales + (long long)expert * (k_chunks / 16) * n}, n};
}

template <typename Weights>
__device__ __forceinline__ void moe_skinny_gemm(bf16* out, const uint4* a, long long a_stride, const uint4* weight,
                                                const float* scales, const int* sorted_entries, int gather_div,
                                                const int* offsets, const int* tiles, const int* tile_count, int n,
                                                int k_chunks, int gated, float limit) {
    const int tile = blockIdx.y;
    if (tile >= tile_count[0]) return;
    const int expert = tiles[2 * tile], row0 = tiles[2 * tile + 1];
    const int rows = min(8, offsets[expert + 1] - row0), width = gated ? n / 2 : n;
    skinny_gemm<1>(out + (long long)row0 * width, (long long)width,
                   TileRows{a, a_stride, sorted_entries, gather_div, row0},
                   expert_weights(weight, scales, expert, n, k_chunks, Weights{}),
                   static_cast<const bf16*>(nullptr), rows, n, k_chunks, 0, gated, limit);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M8)
moe_skinny_gemm_m8(bf16* out, const uint4* a, long long a_stride, const uint4* weight, const int* sorted_entries,
                   int gather_div, const int* offsets, const int* tiles, const int* tile_count, int n, int k_chunks,
                   int gated, float limit) {
    wait_for_previous_kernel();
    moe_skinny_gemm<Bf16Weights>(out, a, a_stride, weight, nullptr, sorted_entries, gather_div, offsets, tiles,
                                 tile_count, n, k_chunks, gated, limit);
}

// FP8 experts (sm_89 and later): weight [E, N, K] e4m3, each load widened in registers to the bf16 weight it
// dequantizes to: _fp8, scales [E, N] float32 (skinny_gemm.cuh's Fp8RowWeights), K % 16 == 0; _fp8_blocks, a row's
// scale for each 128 columns, [E, K / 128, N] (Fp8BlockWeights: DeepSeek's and Qwen3's releases), K % 128 == 0.
#define MOE_SKINNY_GEMM_FP8(NAME, WEIGHTS)                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M8) NAME(bf16* out, const uint4* a,             \
        long long a_stride, const uint4* weight, const float* scales, const int* sorted_entries, int gather_div,   \
        const int* offsets, const int* tiles, const int* tile_count, int n, int k_chunks, int gated, float limit) {\
        wait_for_previous_kernel();                                                                                \
        moe_skinny_gemm<WEIGHTS>(out, a, a_stride, weight, scales, sorted_entries, gather_div, offsets, tiles,     \
                                 tile_count, n, k_chunks, gated, limit);                                           \
    }
MOE_SKINNY_GEMM_FP8(moe_skinny_gemm_m8_fp8, Fp8RowWeights)
MOE_SKINNY_GEMM_FP8(moe_skinny_gemm_m8_fp8_blocks, Fp8BlockWeights)

// Tiles of 64 or 128 rows (prefills, and decode batches of more than a few rows an expert): a CTA of 4 warps owns
// BN = 128 columns of a tile, over BK of K at a time in a STAGES-deep cp.async ring (48 KB of static shared memory):
// BM 128, BK 32, 3 stages; BM 64, BK 64, 2 stages (at 64-row tiles 17% faster than BK 32 in 4). Warps split the tile
// 2 x 2 (BM 128: 64 x 64 each) or 1 x 4 (BM 64: 64 x 32 each); fragments come from shared memory by ldmatrix.x4. A
// tile row is BK / 8 16-byte chunks; chunk c of row r sits at chunk c ^ ((r >> 1) & 3) (BK 32: two rows a 128-byte
// line) or c ^ (r & 7) (BK 64), so that the 8 rows an ldmatrix matrix reads fall in 8 different bank groups. Each
// thread gathers its rows' addresses of a once, before the K loop.
// Grid: (ceil(N / BN), max_tiles); block: GEMM_THREADS.
namespace {

constexpr int GEMM_THREADS = 128, BN = 128;
constexpr int GEMM_SHARED_BYTES = 48 * 1024;

// FP8: the experts' weights e4m3 with a float32 scale a row ([E, N] scales), or in blocks a row's scale for each
// FP8_BLOCK columns ([E, K / FP8_BLOCK, N]: a stage's BK columns lie in one block). A stage then holds the BN weight
// rows' e4m3 bytes (half a bf16 tile), each thread's 16-byte copies widened by that thread, once landed, to bf16(value
// x scale) in the swizzled bf16 tile `wide` (one, not one a stage), which the mma reads as it reads a bf16 stage:
// W8A16, the bf16 GEMM of the dequantized weights, bit for bit. A barrier between the widening and the mma.
constexpr int FP8_BLOCK = 128;
template <int BM, bool FP8 = false>
struct GroupedGemm {
    static constexpr int BK = BM == 64 ? 64 : 32, ROW_CHUNKS = BK / 8;
    static constexpr int WARPS_M = BM / 64, WARPS_N = 4 / WARPS_M;
    static constexpr int WARP_N = BN / WARPS_N, N_TILES = WARP_N / 8;          // 8-column mma tiles of a warp
    static constexpr int W_STAGE_CHUNKS = FP8 ? BN * ROW_CHUNKS / 2 : BN * ROW_CHUNKS;
    static constexpr int STAGE_CHUNKS = BM * ROW_CHUNKS + W_STAGE_CHUNKS;      // 16-byte chunks a stage
    static constexpr int WIDE_CHUNKS = FP8 ? BN * ROW_CHUNKS : 0;              // the widened weight tile
    // 2 (BM 64) or 3 (BM 128), either form.
    static constexpr int STAGES = (GEMM_SHARED_BYTES - 16 * WIDE_CHUNKS) / (16 * STAGE_CHUNKS);
    static constexpr int A_LOADS = BM * ROW_CHUNKS / GEMM_THREADS;              // chunks a thread copies a stage
    static constexpr int W_LOADS = BN * ROW_CHUNKS / GEMM_THREADS;
    static constexpr int ROW_STEP = GEMM_THREADS / ROW_CHUNKS;                  // rows between a thread's copies
    // FP8: a weight row's BK bytes are W8_ROW 16-byte copies; a thread's W8_LOADS rows W8_STEP apart.
    static constexpr int W8_ROW = BK / 16, W8_LOADS = BN * W8_ROW / GEMM_THREADS, W8_STEP = GEMM_THREADS / W8_ROW;
    static_assert(BM == 64 || BM == 128, "tiles of 64 or 128 rows");
    static_assert(STAGES >= 2, "a stage in flight while one is read");
    static_assert(FP8_BLOCK % BK == 0, "a stage's columns in one scale block");

    static __device__ __forceinline__ int swizzled(int row, int chunk) {
        return row * ROW_CHUNKS + (ROW_CHUNKS == 4 ? chunk ^ ((row >> 1) & 3) : chunk ^ (row & 7));
    }
};

// weight: [E, N, K] bf16, or e4m3 (FP8) with scales [E, N], or [E, K / FP8_BLOCK, N] (BLOCKS).
template <int BM, bool GATED, bool FP8 = false, bool BLOCKS = false>
__device__ __forceinline__ void grouped_gemm(bf16* out, const bf16* a, long long a_stride, const void* weight,
                                             const float* scales, const int* sorted_entries, int gather_div,
                                             const int* offsets, const int* tiles, const int* tile_count, int n,
                                             int k, float limit) {
    using G = GroupedGemm<BM, FP8>;
    const int tile = blockIdx.y;
    if (tile >= tile_count[0]) return;
    const int expert = tiles[2 * tile], row0 = tiles[2 * tile + 1];
    const int rows = min(BM, offsets[expert + 1] - row0), col0 = blockIdx.x * BN;
    const bf16* w = static_cast<const bf16*>(weight) + (long long)expert * n * k;
    const unsigned char* w8 = static_cast<const unsigned char*>(weight) + (long long)expert * n * k;
    __shared__ __align__(128) uint4 ring[G::STAGES][G::STAGE_CHUNKS];     // a stage: BM a rows, then BN w rows
    __shared__ __align__(128) uint4 wide[FP8 ? G::WIDE_CHUNKS : 1];       // FP8: the stage's w rows in bf16
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp_row = (warp / G::WARPS_N) * 64, warp_col = (warp % G::WARPS_N) * G::WARP_N;
    const int chunk = threadIdx.x % G::ROW_CHUNKS;          // the 16-byte chunk of BK this thread copies, every row

    // Row r of a stage's copies: a's rows threadIdx.x / 4 + ROW_STEP i; w's the same of the BN weight rows.
    const bf16* a_rows[G::A_LOADS];
    bool a_valid[G::A_LOADS];
#pragma unroll
    for (int i = 0; i < G::A_LOADS; ++i) {
        const int r = threadIdx.x / G::ROW_CHUNKS + G::ROW_STEP * i;
        a_valid[i] = r < rows;
        const int source = !a_valid[i] ? 0 : gather_div ? sorted_entries[row0 + r] / gather_div : row0 + r;
        a_rows[i] = a + (long long)source * a_stride + chunk * 8;
    }
    auto load = [&](int stage, int k0) {
        const bool k_valid = k0 + chunk * 8 < k;
        uint4* s = ring[stage];
#pragma unroll
        for (int i = 0; i < G::A_LOADS; ++i) {
            const int r = threadIdx.x / G::ROW_CHUNKS + G::ROW_STEP * i;
            const bool valid = a_valid[i] && k_valid;
            copy_async_16(s + G::swizzled(r, chunk), valid ? a_rows[i] + k0 : a, valid);
        }
        if constexpr (FP8) {
#pragma unroll
            for (int i = 0; i < G::W8_LOADS; ++i) {
                const int r = threadIdx.x / G::W8_ROW + G::W8_STEP * i, c = threadIdx.x % G::W8_ROW;
                const bool valid = col0 + r < n && k0 + c * 16 < k;
                copy_async_16(s + BM * G::ROW_CHUNKS + r * G::W8_ROW + c,
                              valid ? w8 + (long long)(col0 + r) * k + k0 + c * 16 : w8, valid);
            }
        } else {
#pragma unroll
            for (int i = 0; i < G::W_LOADS; ++i) {
                const int r = threadIdx.x / G::ROW_CHUNKS + G::ROW_STEP * i;
                const bool valid = col0 + r < n && k_valid;
                copy_async_16(s + BM * G::ROW_CHUNKS + G::swizzled(r, chunk),
                              valid ? w + (long long)(col0 + r) * k + k0 + chunk * 8 : w, valid);
            }
        }
    };

    // FP8: the scales of this thread's W8_LOADS weight rows, for the columns from k0 (a row past N widens zeros).
    float row_scale[G::W8_LOADS];
    auto load_scales = [&](int k0) {
        const float* expert_scales = scales + (BLOCKS ? ((long long)expert * (k / FP8_BLOCK) + k0 / FP8_BLOCK) * n
                                                      : (long long)expert * n);
#pragma unroll
        for (int i = 0; i < G::W8_LOADS; ++i) {
            const int r = threadIdx.x / G::W8_ROW + G::W8_STEP * i;
            row_scale[i] = col0 + r < n ? expert_scales[col0 + r] : 0.f;
        }
    };
    if constexpr (FP8) load_scales(0);
    float acc[4][G::N_TILES][4] = {};
    const int steps = (k + G::BK - 1) / G::BK;
#pragma unroll
    for (int stage = 0; stage < G::STAGES - 1; ++stage) {
        if (stage < steps) load(stage, stage * G::BK);
        copy_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        copy_async_wait<G::STAGES - 2>();     // this step's stage has landed (for this thread's copies) ...
        __syncthreads();                       // ... and everyone's; the stage refilled below is consumed by all
        const int next = step + G::STAGES - 1;
        if (next < steps) load(next % G::STAGES, next * G::BK);
        copy_async_commit();
        const uint4* s = ring[step % G::STAGES];
        const uint4* w_tile = s + BM * G::ROW_CHUNKS;
        if constexpr (FP8) {     // this thread's own copies, landed: into `wide`, read by all after the barrier
#pragma unroll
            for (int i = 0; i < G::W8_LOADS; ++i) {
                const int r = threadIdx.x / G::W8_ROW + G::W8_STEP * i, c = threadIdx.x % G::W8_ROW;
                const uint4 raw = w_tile[r * G::W8_ROW + c];
                wide[G::swizzled(r, 2 * c)] = e4m3x8_to_bf16x8(raw.x, raw.y, row_scale[i]);
                wide[G::swizzled(r, 2 * c + 1)] = e4m3x8_to_bf16x8(raw.z, raw.w, row_scale[i]);
            }
            // In blocks, the next step's scales where it starts a block: read while this step's mmas run.
            if (BLOCKS && step + 1 < steps && (step + 1) * G::BK % FP8_BLOCK == 0) load_scales((step + 1) * G::BK);
            __syncthreads();
            w_tile = wide;
        }
#pragma unroll
        for (int kk = 0; kk < G::BK / 16; ++kk) {
            // A, matrices (rows +0, k +0), (+8, +0), (+0, +8), (+8, +8): lane l gives row l & 15, chunk 2kk + l / 16.
            unsigned frag[4][4];
#pragma unroll
            for (int m = 0; m < 4; ++m)
                ldmatrix_x4(frag[m], s + G::swizzled(warp_row + 16 * m + (lane & 15), 2 * kk + (lane >> 4)));
            // W, two 8-column tiles an ldmatrix: matrices (cols +0, k +0), (+0, +8), (+8, +0), (+8, +8).
#pragma unroll
            for (int j = 0; j < G::N_TILES; j += 2) {
                unsigned b[4];
                ldmatrix_x4(b, w_tile + G::swizzled(warp_col + 8 * j + (lane & 7) + ((lane >> 4) << 3),
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
    if (GATED) {         // tiles j, j + 1 (j even): the gate's and the up's 8 columns at (col0 + warp_col + 8 j) / 2
        const int width = n / 2;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
#pragma unroll
            for (int j = 0; j < G::N_TILES; j += 2) {
                const int col = (col0 + warp_col + 8 * j) / 2 + 2 * t;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = warp_row + 16 * m + g + 8 * half;
                    if (r >= rows || col >= width) continue;
                    *reinterpret_cast<unsigned*>(out + (long long)(row0 + r) * width + col) = float2_to_bf16x2(
                        silu_mul_of_rounded(acc[m][j][2 * half], acc[m][j + 1][2 * half], limit),
                        silu_mul_of_rounded(acc[m][j][2 * half + 1], acc[m][j + 1][2 * half + 1], limit));
                }
            }
        }
        return;
    }
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

// moe_grouped_gemm_m{64,128}[_gated]: the tile rows, and the activation in the epilogue (gated; limit: its clamp) or
// not. The _fp8 entries (sm_89 and later) take e4m3 weights [E, N, K] and their scales [E, N] (K % 16 == 0); the
// _fp8_blocks entries scales [E, K / 128, N] (K % 128 == 0).
#define MOE_GROUPED_GEMM(NAME, BM, GATED)                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) NAME(bf16* out, const bf16* a, long long a_stride,  \
        const bf16* weight, const int* sorted_entries, int gather_div, const int* offsets, const int* tiles,       \
        const int* tile_count, int n, int k, float limit) {                                                        \
        wait_for_previous_kernel();                                                                                \
        grouped_gemm<BM, GATED>(out, a, a_stride, weight, nullptr, sorted_entries, gather_div, offsets, tiles,     \
                                tile_count, n, k, limit);                                                          \
    }
#define MOE_GROUPED_GEMM_FP8(NAME, BM, GATED, BLOCKS)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) NAME(bf16* out, const bf16* a, long long a_stride,  \
        const unsigned char* weight, const float* scales, const int* sorted_entries, int gather_div,               \
        const int* offsets, const int* tiles, const int* tile_count, int n, int k, float limit) {                  \
        wait_for_previous_kernel();                                                                                \
        grouped_gemm<BM, GATED, true, BLOCKS>(out, a, a_stride, weight, scales, sorted_entries, gather_div,        \
                                              offsets, tiles, tile_count, n, k, limit);                            \
    }
MOE_GROUPED_GEMM(moe_grouped_gemm_m64, 64, false)
MOE_GROUPED_GEMM(moe_grouped_gemm_m128, 128, false)
MOE_GROUPED_GEMM(moe_grouped_gemm_m64_gated, 64, true)
MOE_GROUPED_GEMM(moe_grouped_gemm_m128_gated, 128, true)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m64_fp8, 64, false, false)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m128_fp8, 128, false, false)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m64_gated_fp8, 64, true, false)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m128_gated_fp8, 128, true, false)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m64_fp8_blocks, 64, false, true)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m128_fp8_blocks, 128, false, true)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m64_gated_fp8_blocks, 64, true, true)
MOE_GROUPED_GEMM_FP8(moe_grouped_gemm_m128_gated_fp8_blocks, 128, true, true)

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
