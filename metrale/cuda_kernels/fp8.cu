// FP8 activations for the W8A8 GEMMs of FP8 weights (cuBLASLt's e4m3 matmul): a linear's input quantized per
// token, as loading/fp8.py quantizes a weight per row, for a weight with a scale a row; or per token and 128
// columns, for a weight with a scale a row per 128 columns (DeepSeek's recipe). sm_89 and later.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr float E4M3_MAX = 448.f;

__device__ __forceinline__ float chunk_max(uint4 v) {
    const float2 a = bf16x2_to_float2(v.x), b = bf16x2_to_float2(v.y), c = bf16x2_to_float2(v.z),
                 d = bf16x2_to_float2(v.w);
    return fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y))),
                 fmaxf(fmaxf(fabsf(c.x), fabsf(c.y)), fmaxf(fabsf(d.x), fabsf(d.y))));
}

__device__ __forceinline__ unsigned int quantize_pair(unsigned int packed, float scale) {
    const float2 v = bf16x2_to_float2(packed);
    return float2_to_e4m3x2(v.x / scale, v.y / scale);
}

}  // namespace

// q [M, K] e4m3 (contiguous, as 8-byte chunks) and scales [M] float32 from x [M, K] bf16 (row stride x_stride
// 16-byte chunks; x may be a column slice): scales[r] = max |x[r]| / 448 (1 for a row of zeros), q[r][c] = x[r][c] /
// scales[r] rounded to nearest e4m3. k_chunks = K / 8. Grid: M CTAs of 256 threads; the row is read twice (its
// largest magnitude, then its values: from L1 or L2 the second time).
extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_e4m3(uint2* q, float* scales, const uint4* x,
                                                                         long long x_stride, int k_chunks) {
    wait_for_previous_kernel();
    const uint4* row = x + blockIdx.x * x_stride;
    float amax = 0.f;
    for (int c = threadIdx.x; c < k_chunks; c += THREADS) amax = fmaxf(amax, chunk_max(row[c]));
    amax = block_reduce(amax, 0.f, Max());
    const float scale = amax > 0.f ? amax / E4M3_MAX : 1.f;
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    uint2* out = q + (long long)blockIdx.x * k_chunks;
    for (int c = threadIdx.x; c < k_chunks; c += THREADS) {
        const uint4 v = row[c];
        out[c] = make_uint2(quantize_pair(v.x, scale) | quantize_pair(v.y, scale) << 16,
                            quantize_pair(v.z, scale) | quantize_pair(v.w, scale) << 16);
    }
}

// q [M, K] e4m3 (contiguous) and scales [K / 128, M] float32 (a column group's M scales together: cuBLASLt's
// VEC128_32F) from x [M, K] bf16 (row stride x_stride 16-byte chunks): scales[g][r] = max |x[r][128 g, 128 g + 128)|
// / 448 (1 for a group of zeros), q[r][c] = x[r][c] / scales[c / 128][r] rounded to nearest e4m3. k_chunks = K / 8,
// a multiple of 16. Grid: M CTAs of 256 threads; a lane a chunk, a group's 16 chunks a half warp's, whose largest
// magnitude its shuffles find: x is read once.
extern "C" __global__ void __launch_bounds__(THREADS) quantize_groups_e4m3(uint2* q, float* scales, const uint4* x,
                                                                           long long x_stride, int k_chunks, int m) {
    wait_for_previous_kernel();
    const uint4* row = x + blockIdx.x * x_stride;
    uint2* out = q + (long long)blockIdx.x * k_chunks;
    const unsigned int half_warp = 0xffffu << (threadIdx.x & 16);
    // A half warp's 16 lanes take one group's 16 chunks together (THREADS and k_chunks are multiples of 16).
    for (int c = threadIdx.x; c < k_chunks; c += THREADS) {
        const uint4 v = row[c];
        float amax = chunk_max(v);
#pragma unroll
        for (int offset = 8; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half_warp, amax, offset));
        const float scale = amax > 0.f ? amax / E4M3_MAX : 1.f;
        if ((c & 15) == 0) scales[(long long)(c >> 4) * m + blockIdx.x] = scale;
        out[c] = make_uint2(quantize_pair(v.x, scale) | quantize_pair(v.y, scale) << 16,
                            quantize_pair(v.z, scale) | quantize_pair(v.w, scale) << 16);
    }
}
