// Skinny GEMM ("GEMV") for decode linears: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), M <= 16: the
// kernels of skinny_gemm.cuh (its comment gives the design) over x's rows as they are, for a bf16 weight and for an
// e4m3 weight with one float32 scale a row or one a row per 128 columns (widened in registers to the bf16 weight it
// dequantizes to); and a dense gated MLP's gate/up with its activation, silu(gate) * up, in the same launch.
#include "skinny_gemm.cuh"

// Grid: ceil(N / 16) CTAs of 256 threads. x_stride in 16-byte chunks, out_stride in elements, k_chunks = K / 8;
// relu != 0: max(., 0) after the bias.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M8) skinny_gemm_m8_bf16(
    bf16* out, long long out_stride, const uint4* x, long long x_stride, const uint4* weight, const bf16* bias,
    int m, int n, int k_chunks, int relu) {
    wait_for_previous_kernel();
    skinny_gemm<1>(out, out_stride, StridedRows{x, x_stride}, Bf16Weights{weight}, bias, m, n, k_chunks, relu);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M8) skinny_gemm_m8_f32(
    float* out, long long out_stride, const uint4* x, long long x_stride, const uint4* weight, const float* bias,
    int m, int n, int k_chunks, int relu) {
    wait_for_previous_kernel();
    skinny_gemm<1>(out, out_stride, StridedRows{x, x_stride}, Bf16Weights{weight}, bias, m, n, k_chunks, relu);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M16) skinny_gemm_m16_bf16(
    bf16* out, long long out_stride, const uint4* x, long long x_stride, const uint4* weight, const bf16* bias,
    int m, int n, int k_chunks, int relu) {
    wait_for_previous_kernel();
    skinny_gemm<2>(out, out_stride, StridedRows{x, x_stride}, Bf16Weights{weight}, bias, m, n, k_chunks, relu);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_M16) skinny_gemm_m16_f32(
    float* out, long long out_stride, const uint4* x, long long x_stride, const uint4* weight, const float* bias,
    int m, int n, int k_chunks, int relu) {
    wait_for_previous_kernel();
    skinny_gemm<2>(out, out_stride, StridedRows{x, x_stride}, Bf16Weights{weight}, bias, m, n, k_chunks, relu);
}

// FP8 weights (sm_89 and later): weight [N, K] e4m3 as 16-byte loads (K / 16 a row; k_chunks = K / 8 as above);
// scales [N] float32 (Fp8RowWeights), or, _blocks, a scale a row for each 128 columns (a checkpoint's 128 x 128 block
// scales), [K / 128, N] float32 (Fp8BlockWeights); out bf16. WEIGHTS: the weight's form over weight, scales and n.
#define SKINNY_GEMM_FP8(NAME, TOKEN_TILES, MIN_CTAS, WEIGHTS)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) NAME(bf16* out, long long out_stride,          \
        const uint4* x, long long x_stride, const uint4* weight, const float* scales, const bf16* bias, int m,     \
        int n, int k_chunks, int relu) {                                                                           \
        wait_for_previous_kernel();                                                                                \
        skinny_gemm<TOKEN_TILES>(out, out_stride, StridedRows{x, x_stride}, WEIGHTS, bias, m, n, k_chunks, relu);  \
    }
SKINNY_GEMM_FP8(skinny_gemm_m8_fp8, 1, MIN_CTAS_M8, (Fp8RowWeights{weight, scales}))
SKINNY_GEMM_FP8(skinny_gemm_m16_fp8, 2, MIN_CTAS_M16, (Fp8RowWeights{weight, scales}))
SKINNY_GEMM_FP8(skinny_gemm_m8_fp8_blocks, 1, MIN_CTAS_M8, (Fp8BlockWeights{{weight, scales}, n}))
SKINNY_GEMM_FP8(skinny_gemm_m16_fp8_blocks, 2, MIN_CTAS_M16, (Fp8BlockWeights{{weight, scales}, n}))

// A dense gated MLP's out [M, half] = silu(x @ gate^T) * (x @ up^T), bf16, from its weight [gate; up] [2 half, K]
// (half % 8 == 0) in any of the forms above (scales: null for bf16): the gated skinny_gemm over GateUpHalves,
// bit for bit the skinny GEMM's [M, 2 half] followed by activation.cu's silu_mul. Grid: 2 half / 16 CTAs.
#define SKINNY_GEMM_GATED(NAME, TOKEN_TILES, MIN_CTAS, WEIGHTS)                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) NAME(bf16* out, long long out_stride,          \
        const uint4* x, long long x_stride, const uint4* weight, const float* scales, int m, int half,            \
        int k_chunks) {                                                                                            \
        wait_for_previous_kernel();                                                                                \
        const int n = 2 * half;                                                                                    \
        skinny_gemm<TOKEN_TILES>(out, out_stride, StridedRows{x, x_stride}, WEIGHTS, (const bf16*)nullptr, m, n,   \
                                 k_chunks, 0, 1);                                                                  \
    }
SKINNY_GEMM_GATED(skinny_gated_m8_bf16, 1, MIN_CTAS_M8, (GateUpHalves<Bf16Weights>{{weight}, half}))
SKINNY_GEMM_GATED(skinny_gated_m16_bf16, 2, MIN_CTAS_M16, (GateUpHalves<Bf16Weights>{{weight}, half}))
SKINNY_GEMM_GATED(skinny_gated_m8_fp8, 1, MIN_CTAS_M8, (GateUpHalves<Fp8RowWeights>{{weight, scales}, half}))
SKINNY_GEMM_GATED(skinny_gated_m16_fp8, 2, MIN_CTAS_M16, (GateUpHalves<Fp8RowWeights>{{weight, scales}, half}))
SKINNY_GEMM_GATED(skinny_gated_m8_fp8_blocks, 1, MIN_CTAS_M8,
                  (GateUpHalves<Fp8BlockWeights>{{{weight, scales}, n}, half}))
SKINNY_GEMM_GATED(skinny_gated_m16_fp8_blocks, 2, MIN_CTAS_M16,
                  (GateUpHalves<Fp8BlockWeights>{{{weight, scales}, n}, half}))
