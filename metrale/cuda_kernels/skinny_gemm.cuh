// The skinny GEMM ("GEMV") of decode linears (gemv.cu) and of a mixture's experts at decode (moe.cu): out [M, N] =
// x [M, K] @ weight [N, K]^T (+ bias [N]), M <= 16, on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), in one launch that reads every weight byte once.
//
// weight [N, K] bf16, contiguous (nn.Linear layout), passed as 16-byte chunks: k_chunks = K / 8 per row; or e4m3
// with a float32 scale a row (Fp8RowWeights: a lane's 16-byte load is two chunks' weights, 16 of K, widened to bf16
// in registers before their mmas; K % 16 == 0), or a scale a row for each 128 columns (Fp8BlockWeights).
// x [M, K] bf16, row stride x_stride in 16-byte chunks (x may be a column slice). out [M, N] bf16 or float32,
// row stride out_stride in elements; bias [N] of out's dtype or null. Every pointer 16-byte aligned but out's
// and bias's (element-aligned: they are written and read one element at a time).
//
// The product is computed transposed, out^T [N, M] = weight [N, K] @ x^T [K, M], so that the weight is the mma's
// A operand (16 rows n x 16 k, "row": as weight is stored) and x^T its B operand (16 k x 8 tokens, "col": B[k][m]
// = x[m][k], as x is stored). Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type"), lane = 4 g + t, g = lane >> 2 in 0..7, t = lane & 3, two bf16 per .b32 with the lower k in the low half:
//   A 16x16: a0 = A[g][2t, 2t+1]  a1 = A[g+8][2t, 2t+1]  a2 = A[g][2t+8, 2t+9]  a3 = A[g+8][2t+8, 2t+9]
//   B 16x8:  b0 = B[2t, 2t+1][g]  b1 = B[2t+8, 2t+9][g]
//   C 16x8:  c0, c1 = C[g][2t], C[g][2t+1]   c2, c3 = C[g+8][2t], C[g+8][2t+1]
// The mma sums over its 16 logical k; which physical k each logical k stands for is ours to choose, as long as A
// and B agree. Logical k 2t, 2t+1, 2t+8, 2t+9 are held by the lanes of one t alone, in A and in B alike, so let
// them be 4 elements of one 16-byte chunk of this lane's: a lane (g, t) loads chunk c of weight rows g and g + 8
// (w_low, w_high) and chunk c of x row g (x_g), 8 elements each, and feeds two mmas with no shuffle:
//   mma 0: a = {w_low.x, w_high.x, w_low.y, w_high.y}, b = {x_g.x, x_g.y}   (elements 0..3 of the chunk)
//   mma 1: a = {w_low.z, w_high.z, w_low.w, w_high.w}, b = {x_g.z, x_g.w}   (elements 4..7)
// A warp step is 4 chunks (c = 4 step + t, 32 k) of 16 weight rows: each weight load instruction reads 64
// contiguous bytes of 8 rows. An FP8 weight's step is 8 chunks (64 k): lane t loads chunks 8 step + 2t and 2t + 1
// in one 16-byte load, and feeds each chunk's two mmas as above. Tokens 8..15 (M > 8) are a second B tile, x rows
// g + 8, into a second accumulator.
//
// Work split: a CTA of 8 warps owns 16 weight rows; its warps split the row's steps into 8 contiguous ranges
// (splitting K, so that a small N still gives many warps: N = 4096 is 256 CTAs), sum their 16 x M partial
// products in shared memory, and the CTA writes 16 x M outputs (+ bias) once. Each lane loads UNROLL steps (2
// UNROLL streaming 16-byte weight loads) before multiplying any: 4 KB of weight per warp in flight, 96 KB per SM at
// 3 CTAs (M <= 8), 64 KB at 2 (M <= 16), well over bandwidth x latency / SMs (4.8 TB/s x ~1 us / 132 = 36 KB on an
// H200). The weight is read once, with ld.global.nc.L1::no_allocate so it does not push x out of L1: every
// CTA reads all of x (M x K x 2 bytes, tiny next to its 16 x K x 2 of weight when M <= 8), from L1 or L2.
#pragma once
#include "mma.cuh"

namespace {

constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int TILE_ROWS = 16;      // weight rows of a CTA: the mma's M
constexpr int STEP_CHUNKS = 4;     // 16-byte chunks of each row per warp step: one per t
// CTAs per SM that ptxas must fit (its register budget). Asking for them also makes it issue all of a batch's
// loads before the first mma (about 75 and 100 registers on sm_90a); with the bare launch bound it interleaves
// each step's mmas with the next step's loads to save registers, and one step is in flight at a time.
constexpr int MIN_CTAS_M8 = 3, MIN_CTAS_M16 = 2;

// 16 bytes of the weight, or zeros where !valid (no access). Read once, so not kept in L1; L2 fetches the whole
// 256-byte line (4 steps of a row). The predicate is inside the asm so that a batch of loads is one basic block
// (a branch per load makes ptxas peel and reorder the loop).
__device__ __forceinline__ uint4 load_weight(const uint4* pointer, bool valid) {
    uint4 v;
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
                 " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
                 " @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(pointer), "r"((int)valid));
    return v;
}

// 16 bytes of x, or zeros where !valid: re-read by every CTA, so cached in L1 (plain global loads are, on sm_80+).
// Not .nc: x is the previous kernel's output, and programmatic dependent launch orders only coherent loads after
// griddepcontrol.wait (common.cuh); the weight above is written by no kernel, so its .nc loads are safe.
__device__ __forceinline__ uint4 load_activation(const uint4* pointer, bool valid) {
    uint4 v;
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
                 " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
                 " @p ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(pointer), "r"((int)valid));
    return v;
}

// The weight's form, as skinny_gemm reads it: a lane's 16-byte load covers CHUNKS 16-byte chunks of x (8 of K
// each); widen() turns it into those chunks' bf16 weights, ready for the mma, times scale(r, chunk), row r's scale
// at the load's first chunk (read once a row unless BLOCKED, once a load if so); UNROLL, the warp steps loaded
// before the first is multiplied (4 KB of weight in flight a warp for either form).
struct Bf16Weights {          // [N, K] bf16: a load is one chunk, as it is
    static constexpr int CHUNKS = 1, UNROLL = 4;
    static constexpr bool BLOCKED = false;
    const uint4* data;
    __device__ __forceinline__ const uint4* row(int r, int k_chunks) const { return data + (long long)r * k_chunks; }
    __device__ __forceinline__ float scale(int, int) const { return 1.f; }
    __device__ __forceinline__ static void widen(uint4 raw, float, uint4 (&out)[CHUNKS]) { out[0] = raw; }
};

// Two e4m3 (the low byte the lower element) -> two bf16 of their values times scale, packed as float2_to_bf16x2:
// each value exact in f16 and float, multiplied in fp32 and rounded to bf16 once, as a weight dequantized to
// float32 on the host (loading/fp8.py) and uploaded as bf16 would be. sm_89 and later.
__device__ __forceinline__ unsigned int e4m3x2_to_bf16x2(unsigned int pair, float scale) {
#if __CUDA_ARCH__ >= 890
    unsigned int halves;
    float lo, hi;
    asm("{\n .reg .b16 pair, l, h;\n cvt.u16.u32 pair, %3;\n cvt.rn.f16x2.e4m3x2 %0, pair;\n"
        " mov.b32 {l, h}, %0;\n cvt.f32.f16 %1, l;\n cvt.f32.f16 %2, h;\n}\n"
        : "=r"(halves), "=f"(lo), "=f"(hi) : "r"(pair));
    return float2_to_bf16x2(lo * scale, hi * scale);
#else
    __trap();
    return 0;
#endif
}

__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(unsigned int low, unsigned int high, float scale) {
    return make_uint4(e4m3x2_to_bf16x2(low & 0xffffu, scale), e4m3x2_to_bf16x2(low >> 16, scale),
                      e4m3x2_to_bf16x2(high & 0xffffu, scale), e4m3x2_to_bf16x2(high >> 16, scale));
}

struct Fp8RowWeights {        // [N, K] e4m3 with one float32 scale a row: a load is two chunks (16 of K)
    static constexpr int CHUNKS = 2, UNROLL = 4;
    static constexpr bool BLOCKED = false;
    const uint4* data;
    const float* scales;
    __device__ __forceinline__ const uint4* row(int r, int k_chunks) const {
        return data + (long long)r * (k_chunks / CHUNKS);
    }
    __device__ __forceinline__ float scale(int r, int) const { return scales[r]; }
    __device__ __forceinline__ static void widen(uint4 raw, float scale, uint4 (&out)[CHUNKS]) {
        out[0] = e4m3x8_to_bf16x8(raw.x, raw.y, scale);
        out[1] = e4m3x8_to_bf16x8(raw.z, raw.w, scale);
    }
};

// [N, K] e4m3 with a float32 scale a row for each 128 columns, scales [K / 128, N] (a column block's N scales
// together: cuBLASLt's VEC128_32F, as fp8_matrix.py uploads a checkpoint's 128 x 128 block scales): a load's 16
// columns lie in one block (16 chunks a block, a load's first chunk even).
struct Fp8BlockWeights : Fp8RowWeights {
    static constexpr bool BLOCKED = true;
    int n;
    __device__ __forceinline__ float scale(int r, int chunk) const { return scales[(chunk >> 4) * n + r]; }
};

// A dense gated MLP's gate and up stacked as its checkpoint fuses them ([gate; up], `half` rows each, half % 8 == 0),
// read as skinny_gemm's gated form wants its rows (n = 2 half): tile row 16 q + i is the gate's row 8 q + i, tile row
// 16 q + 8 + i the up's, so a CTA's 16 rows are the out columns 8 q .. 8 q + 7. Any weight form.
template <typename Weights>
struct GateUpHalves : Weights {
    int half;
    __device__ __forceinline__ int stacked(int r) const { return ((r >> 4) << 3) + (r & 7) + ((r & 8) ? half : 0); }
    __device__ __forceinline__ const uint4* row(int r, int k_chunks) const {
        return Weights::row(stacked(r), k_chunks);
    }
    __device__ __forceinline__ float scale(int r, int chunk) const { return Weights::scale(stacked(r), chunk); }
};

__device__ __forceinline__ float to_float(bf16 v) { return bf16_to_float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ void store(bf16* p, float v) { *p = float_to_bf16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// x's rows, as the skinny GEMM reads them: row t of a [M, K] tensor of row stride `stride` 16-byte chunks.
struct StridedRows {
    const uint4* x;
    long long stride;
    __device__ __forceinline__ const uint4* operator()(int t) const { return x + t * stride; }
};

// TOKEN_TILES = 1 (M <= 8) or 2 (M <= 16): 8-token B tiles, each with its own accumulator. rows(t): the first
// 16-byte chunk of token t's x row (StridedRows, or a gather). gated (no bias, no relu): the weight is a gated MLP's
// gate and up rows interleaved by 8 (rows 16 q + i and 16 q + 8 + i: the gate's and the up's row 8 q + i; as
// moe.cu's experts are stored, or as GateUpHalves reads a dense MLP's [gate; up]), and out
// [M, N / 2] = silu(gate) * up (common.cuh's silu_mul_of_rounded, with its clamp where limit > 0), N % 16 == 0: a
// CTA's 16 rows are 8 columns.
template <int TOKEN_TILES, typename Out, typename Rows, typename Weights>
__device__ __forceinline__ void skinny_gemm(Out* out, long long out_stride, Rows rows, Weights weight,
                                            const Out* bias, int m, int n, int k_chunks, int relu, int gated = 0,
                                            float limit = 0.f) {
    constexpr int UNROLL = Weights::UNROLL, CHUNKS = Weights::CHUNKS, STEP = STEP_CHUNKS * CHUNKS;
    constexpr int TOKENS = 8 * TOKEN_TILES;
    __shared__ float partial[WARPS][TILE_ROWS][TOKENS];   // each warp's share of out^T for the CTA's 16 rows
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * TILE_ROWS;

    // This warp's steps [step_begin, step_end): an eighth of ceil(K / (32 CHUNKS)), contiguous. A step is STEP
    // chunks; lane t reads its CHUNKS chunks from chunk, chunk + STEP, ... below chunk_end (the warp's range, and K: a
    // load past either reads nothing). K is a multiple of CHUNKS chunks.
    const int steps = (k_chunks + STEP - 1) / STEP;
    const int step_begin = steps * warp / WARPS, step_end = steps * (warp + 1) / WARPS;
    const int chunk_begin = step_begin * STEP + t * CHUNKS;
    const int chunk_end = min(k_chunks, step_end * STEP + t * CHUNKS);

    // This lane's weight rows g, g + 8 and x rows g + 8 j, at chunk_begin; rows past N or M read nothing (zeros).
    const bool low_valid = row0 + g < n, high_valid = row0 + g + 8 < n;
    const uint4* w_low = weight.row(low_valid ? row0 + g : 0, k_chunks) + chunk_begin / CHUNKS;
    const uint4* w_high = weight.row(high_valid ? row0 + g + 8 : 0, k_chunks) + chunk_begin / CHUNKS;
    const int scale_low_row = low_valid ? row0 + g : 0, scale_high_row = high_valid ? row0 + g + 8 : 0;
    const float scale_low = weight.scale(scale_low_row, 0), scale_high = weight.scale(scale_high_row, 0);
    const uint4* x_row[TOKEN_TILES];
    bool x_valid[TOKEN_TILES];
#pragma unroll
    for (int j = 0; j < TOKEN_TILES; ++j) {
        x_valid[j] = g + 8 * j < m;
        x_row[j] = rows(x_valid[j] ? g + 8 * j : 0) + chunk_begin;
    }
    float acc[TOKEN_TILES][4];
#pragma unroll
    for (int j = 0; j < TOKEN_TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    const int batches = (step_end - step_begin + UNROLL - 1) / UNROLL;   // the same in every lane: mma is warp-wide
    for (int batch = 0, chunk = chunk_begin; batch < batches; ++batch, chunk += UNROLL * STEP) {
        uint4 raw_low[UNROLL], raw_high[UNROLL], b[UNROLL][TOKEN_TILES][CHUNKS];
        float s_low[UNROLL], s_high[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const bool k_valid = chunk + u * STEP < chunk_end;
            raw_low[u] = load_weight(w_low + u * STEP_CHUNKS, k_valid && low_valid);
            raw_high[u] = load_weight(w_high + u * STEP_CHUNKS, k_valid && high_valid);
            if constexpr (Weights::BLOCKED) {       // a load past K reads block 0's scale, for nothing
                s_low[u] = weight.scale(scale_low_row, k_valid ? chunk + u * STEP : 0);
                s_high[u] = weight.scale(scale_high_row, k_valid ? chunk + u * STEP : 0);
            } else {
                s_low[u] = scale_low;
                s_high[u] = scale_high;
            }
#pragma unroll
            for (int j = 0; j < TOKEN_TILES; ++j)
#pragma unroll
                for (int c = 0; c < CHUNKS; ++c)
                    b[u][j][c] = load_activation(x_row[j] + u * STEP + c, k_valid && x_valid[j]);
        }
        w_low += UNROLL * STEP_CHUNKS;
        w_high += UNROLL * STEP_CHUNKS;
#pragma unroll
        for (int j = 0; j < TOKEN_TILES; ++j) x_row[j] += UNROLL * STEP;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            uint4 a_low[CHUNKS], a_high[CHUNKS];
            Weights::widen(raw_low[u], s_low[u], a_low);
            Weights::widen(raw_high[u], s_high[u], a_high);
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
                for (int j = 0; j < TOKEN_TILES; ++j) {
                    mma_bf16(acc[j], {a_low[c].x, a_high[c].x, a_low[c].y, a_high[c].y}, b[u][j][c].x, b[u][j][c].y);
                    mma_bf16(acc[j], {a_low[c].z, a_high[c].z, a_low[c].w, a_high[c].w}, b[u][j][c].z, b[u][j][c].w);
                }
        }
    }

    // acc[j] is the C fragment of rows row0 + (g, g + 8), tokens 8 j + (2t, 2t + 1).
#pragma unroll
    for (int j = 0; j < TOKEN_TILES; ++j) {
        partial[warp][g][8 * j + 2 * t] = acc[j][0];
        partial[warp][g][8 * j + 2 * t + 1] = acc[j][1];
        partial[warp][g + 8][8 * j + 2 * t] = acc[j][2];
        partial[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
    }
    __syncthreads();
    if (gated) {             // one thread per (token, column): the column's gate row r and up row r + 8
        if (threadIdx.x < TILE_ROWS / 2 * TOKENS) {
            const int r = threadIdx.x % (TILE_ROWS / 2), token = threadIdx.x / (TILE_ROWS / 2);
            if (token < m && row0 + r < n) {
                float gate = 0.f, up = 0.f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) {
                    gate += partial[w][r][token];
                    up += partial[w][r + TILE_ROWS / 2][token];
                }
                store(out + token * out_stride + row0 / 2 + r, silu_mul_of_rounded(gate, up, limit));
            }
        }
        return;
    }
    // One thread per (token, row) of the tile; consecutive threads write consecutive columns of out.
    if (threadIdx.x < TILE_ROWS * TOKENS) {
        const int r = threadIdx.x % TILE_ROWS, token = threadIdx.x / TILE_ROWS, row = row0 + r;
        if (token < m && row < n) {
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) sum += partial[w][r][token];
            if (bias != nullptr) sum += to_float(bias[row]);
            if (relu) sum = fmaxf(sum, 0.f);                   // as activation.cu's relu
            store(out + token * out_stride + row, sum);
        }
    }
}

}  // namespace
