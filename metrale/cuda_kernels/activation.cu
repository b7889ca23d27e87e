// MLP activations: the gated out = silu(gate) * up in fp32, rounded to bf16 once; ReLU (M2M100 / NLLB) and its
// square (Nemotron-H); elementwise add and x * silu(gate) (the SSM hybrids), x * sigmoid(gate) (Hy4's gated
// attention).
#include "common.cuh"

__device__ __forceinline__ unsigned int silu_mul_pair(unsigned int gate, unsigned int up) {
    const float2 g = bf16x2_to_float2(gate), u = bf16x2_to_float2(up);
    return float2_to_bf16x2(silu(g.x) * u.x, silu(g.y) * u.y);
}

// out [T, I], gate_up [T, 2I] = [gate | up], bf16; row strides in 16-byte units (8 bf16), I % 8 == 0.
// A flat grid over the T * I / 8 units of out, one unit per thread.
extern "C" __global__ void silu_mul(uint4* out, long long out_stride, const uint4* gate_up, long long gate_up_stride,
                                    int num_tokens, int units_per_row) {
    wait_for_previous_kernel();
    const long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (long long)num_tokens * units_per_row) return;
    const long long row = unit / units_per_row;
    const int column = (int)(unit - row * units_per_row);
    const uint4* gate_row = gate_up + row * gate_up_stride;
    const uint4 g = gate_row[column], u = gate_row[units_per_row + column];
    out[row * out_stride + column] = make_uint4(silu_mul_pair(g.x, u.x), silu_mul_pair(g.y, u.y),
                                                silu_mul_pair(g.z, u.z), silu_mul_pair(g.w, u.w));
}

__device__ __forceinline__ unsigned int relu_pair(unsigned int x, int square) {
    const float2 v = bf16x2_to_float2(x);
    const float a = fmaxf(v.x, 0.f), b = fmaxf(v.y, 0.f);
    return square ? float2_to_bf16x2(a * a, b * b) : float2_to_bf16x2(a, b);
}

// out [T, I] = max(x, 0) (M2M100), or its square with square = 1 (Nemotron-H's MLP), bf16; row strides in 16-byte
// units, I % 8 == 0; one 16-byte unit per thread.
extern "C" __global__ void relu(uint4* out, long long out_stride, const uint4* x, long long x_stride, int num_tokens,
                                int units_per_row, int square) {
    wait_for_previous_kernel();
    const long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (long long)num_tokens * units_per_row) return;
    const long long row = unit / units_per_row;
    const int column = (int)(unit - row * units_per_row);
    const uint4 v = x[row * x_stride + column];
    out[row * out_stride + column] = make_uint4(relu_pair(v.x, square), relu_pair(v.y, square),
                                                relu_pair(v.z, square), relu_pair(v.w, square));
}

__device__ __forceinline__ unsigned int add_pair(unsigned int x, unsigned int y) {
    const float2 a = bf16x2_to_float2(x), b = bf16x2_to_float2(y);
    return float2_to_bf16x2(a.x + b.x, a.y + b.y);
}

__device__ __forceinline__ unsigned int mul_silu_pair(unsigned int x, unsigned int gate) {
    const float2 a = bf16x2_to_float2(x), g = bf16x2_to_float2(gate);
    return float2_to_bf16x2(a.x * silu(g.x), a.y * silu(g.y));
}

__device__ __forceinline__ unsigned int mul_sigmoid_pair(unsigned int x, unsigned int gate) {
    const float2 a = bf16x2_to_float2(x), g = bf16x2_to_float2(gate);
    return float2_to_bf16x2(a.x / (1.f + __expf(-g.x)), a.y / (1.f + __expf(-g.y)));
}

// out [T, I] = x + y (op 0), x * silu(y) (op 1) or x * sigmoid(y) (op 2), bf16 in and out, fp32 math rounded
// once; row strides in 16-byte units, I % 8 == 0; one 16-byte unit per thread.
extern "C" __global__ void binary(uint4* out, long long out_stride, const uint4* x, long long x_stride, const uint4* y,
                                  long long y_stride, int num_tokens, int units_per_row, int op) {
    wait_for_previous_kernel();
    const long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= (long long)num_tokens * units_per_row) return;
    const long long row = unit / units_per_row;
    const int column = (int)(unit - row * units_per_row);
    const uint4 a = x[row * x_stride + column], b = y[row * y_stride + column];
    out[row * out_stride + column] =
        op == 0   ? make_uint4(add_pair(a.x, b.x), add_pair(a.y, b.y), add_pair(a.z, b.z), add_pair(a.w, b.w))
        : op == 1 ? make_uint4(mul_silu_pair(a.x, b.x), mul_silu_pair(a.y, b.y), mul_silu_pair(a.z, b.z),
                               mul_silu_pair(a.w, b.w))
                  : make_uint4(mul_sigmoid_pair(a.x, b.x), mul_sigmoid_pair(a.y, b.y), mul_sigmoid_pair(a.z, b.z),
                               mul_sigmoid_pair(a.w, b.w));
}
