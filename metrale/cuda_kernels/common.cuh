// Shared device helpers: bf16 <-> float without cuda_bf16.h (NVRTC ships no CUDA headers), warp reductions,
// and the programmatic-dependent-launch handshake every kernel starts with.
#pragma once

// Programmatic dependent launch (sm_90 and later; kernels are launched with programmatic stream serialization
// there, so a kernel may start while the one before it in the stream is still running). Every kernel calls this
// first, in every CTA, before it touches global memory: it waits until the previous kernel has finished and its
// writes are visible, then lets the next kernel start launching (its CTAs fill SMs as ours drain, and wait here
// in turn). A grid none of whose CTAs waited could finish before its predecessor, and the next kernel's wait would
// no longer cover the one before: every CTA waiting is the simple sufficient rule. The wait orders ordinary
// (coherent) loads only: data another kernel writes is never read through the non-coherent path (ld.global.nc,
// __ldg, or const __restrict__ pointers the compiler may turn into those); weights, written by no kernel, may be.
// On earlier architectures launches serialize as usual.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

typedef unsigned short bf16;   // raw bfloat16 bits

__device__ __forceinline__ float bf16_to_float(bf16 x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

__device__ __forceinline__ bf16 float_to_bf16(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two bf16 packed in 32 bits <-> float2.
__device__ __forceinline__ float2 bf16x2_to_float2(unsigned int packed) {
    return make_float2(__uint_as_float(packed << 16), __uint_as_float(packed & 0xffff0000u));
}

__device__ __forceinline__ unsigned int float2_to_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// silu(x) = x * sigmoid(x), in fp32 (expf, not __expf: the same value in every kernel that takes it).
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// A gated MLP's activation silu(gate) * up in fp32 from gate and up as bf16 would hold them (both rounded first, as
// when a GEMM writes them and activation.cu's silu_mul reads them back), rounded to bf16 by the caller.
__device__ __forceinline__ float silu_mul_of_rounded(float gate, float up, float limit = 0.f) {
    float g = bf16_to_float(float_to_bf16(gate)), u = bf16_to_float(float_to_bf16(up));
    if (limit > 0.f) {      // Hy4's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit)
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return silu(g) * u;
}

// Rotate-half rotary embedding of two dims of each of a pair: first holds dims i, i + 1 and second dims i + half,
// i + half + 1 (bf16 pairs); c, s their angles' cos and sin. In fp32, each result rounded to bf16 once.
__device__ __forceinline__ void rotate_pair2(unsigned int& first, unsigned int& second, float c0, float c1, float s0,
                                             float s1) {
    const float2 x1 = bf16x2_to_float2(first), x2 = bf16x2_to_float2(second);
    first = float2_to_bf16x2(x1.x * c0 - x2.x * s0, x1.y * c1 - x2.y * s1);
    second = float2_to_bf16x2(x2.x * c0 + x1.x * s0, x2.y * c1 + x1.y * s1);
}

// 8 bf16 in a uint4 <-> 8 floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    float2 a = bf16x2_to_float2(v.x), b = bf16x2_to_float2(v.y), c = bf16x2_to_float2(v.z), d = bf16x2_to_float2(v.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(float2_to_bf16x2(f[0], f[1]), float2_to_bf16x2(f[2], f[3]), float2_to_bf16x2(f[4], f[5]),
                      float2_to_bf16x2(f[6], f[7]));
}

// e4m3 (FP8 weights, activations and KV cache; sm_89 and later, elsewhere a trap). Two floats -> two e4m3 (lo in
// the low byte), rounded to nearest even, saturating at +-448.
__device__ __forceinline__ unsigned int float2_to_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Two e4m3 (the low byte the lower index) -> two bf16, exactly (every e4m3 value is a bf16 one): through f16x2,
// which holds them exactly too.
__device__ __forceinline__ unsigned int e4m3x2_to_bf16x2(unsigned short pair) {
#if __CUDA_ARCH__ >= 890
    float lo, hi;
    asm("{\n .reg .b32 h2;\n .reg .b16 l, h;\n cvt.rn.f16x2.e4m3x2 h2, %2;\n mov.b32 {l, h}, h2;\n"
        " cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}" : "=f"(lo), "=f"(hi) : "h"(pair));
    return float2_to_bf16x2(lo, hi);
#else
    __trap();
    return 0;
#endif
}

// RMSNorm's scaling as transformers' LlamaRMSNorm computes it in bf16: bf16(weight * bf16(value * inv_rms)), two
// at a time (norm.cu, and the norms fused into other kernels).
__device__ __forceinline__ unsigned int scale_pair(unsigned int value, unsigned int weight, float inv_rms) {
    const float2 v = bf16x2_to_float2(value), w = bf16x2_to_float2(weight);
    const float2 n = bf16x2_to_float2(float2_to_bf16x2(v.x * inv_rms, v.y * inv_rms));
    return float2_to_bf16x2(w.x * n.x, w.y * n.y);
}

// Reduction operators for warp_reduce / block_reduce. Max on floats is fmaxf: a NaN loses to any number.
struct Sum {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct Min {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};

// op over the 32 lanes of a warp; every lane gets the result.
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// op over a block of blockDim.x threads (a multiple of 32, at most 1024), `identity` standing in for the warps the
// block lacks; every thread gets the result. Starts with a __syncthreads, so calls can follow each other.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T identity, Op op) {
    __shared__ T partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : identity;
    return warp_reduce(v, op);
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, Sum()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, Max()); }
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.f, Sum()); }
