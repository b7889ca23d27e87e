// RMSNorm as transformers' LlamaRMSNorm computes it in bf16: variance in fp32 over the bf16 input,
// normalised value rounded to bf16, then weight * normalised in fp32 and rounded once.
// The optional residual add rounds x + residual to bf16 first (as a bf16 torch add), and the norm reads
// that rounded sum. Pointers are not __restrict__: out may alias x, residual_out may alias x or residual
// (each thread reads its elements before it writes them).
#include "common.cuh"

#define RMS_NORM_MAX_UNITS 4        // 16-byte units (8 bf16) per thread: hidden <= 4 * 8 * blockDim.x
#define HEAD_NORM_MAX_UNITS 4       // 4-byte units (2 bf16) per lane: head_dim <= 4 * 2 * 32 = 256
#define HEAD_NORM_WARPS 4
#define MAX_PARTIALS 8              // layer_norm_partials' split-K partials at the most

// One row of a norm's input, in 16-byte units: x's, plus residual's where given (rounded to bf16 as a bf16 torch
// add), the sum also stored to residual_out where given (both may be null). A null x reads as a zero row
// (layer_norm_gathered's index outside its table).
struct ResidualRow {
    const uint4* x;
    const uint4* residual;
    uint4* residual_out;

    __device__ __forceinline__ ResidualRow(long long row, const bf16* x_base, long long x_stride,
                                           const bf16* residual_base, long long residual_stride,
                                           bf16* residual_out_base, long long residual_out_stride)
        : x(reinterpret_cast<const uint4*>(x_base + row * x_stride)),
          residual(residual_base ? reinterpret_cast<const uint4*>(residual_base + row * residual_stride) : nullptr),
          residual_out(residual_out_base ? reinterpret_cast<uint4*>(residual_out_base + row * residual_out_stride)
                                         : nullptr) {}

    __device__ __forceinline__ ResidualRow(const uint4* x_row, const uint4* residual_row, uint4* residual_out_row)
        : x(x_row), residual(residual_row), residual_out(residual_out_row) {}

    __device__ __forceinline__ uint4 load(int i) const {
        uint4 v = x ? x[i] : make_uint4(0u, 0u, 0u, 0u);
        if (residual) {
            float a[8], b[8];
            unpack8(v, a);
            unpack8(residual[i], b);
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] += b[j];
            v = pack8(a);
        }
        if (residual_out) residual_out[i] = v;
        return v;
    }
};

// This thread's first 16-byte unit of a norm's weight and bias (bias may be null): a row's only one up to hidden
// 8192 (the launchers' _block). They are model weights, so they are loaded before the row, their round trip with
// the row's, where after the row's stores (which they might alias, for the compiler) and the block's reductions
// they were one more round trip at the end of every norm. Later units are loaded where they are used.
struct FirstUnits {
    uint4 weight, bias;

    __device__ __forceinline__ FirstUnits(const bf16* weight_base, const bf16* bias_base, int units)
        : weight(make_uint4(0u, 0u, 0u, 0u)), bias(make_uint4(0u, 0u, 0u, 0u)) {
        if ((int)threadIdx.x < units) {
            weight = reinterpret_cast<const uint4*>(weight_base)[threadIdx.x];
            if (bias_base) bias = reinterpret_cast<const uint4*>(bias_base)[threadIdx.x];
        }
    }
};

// One block per row; x, residual, out, residual_out [T, hidden] bf16 with row strides in elements (multiples
// of 8), weight [hidden]. residual and residual_out may be null. hidden % 8 == 0, every row 16-byte aligned.
// With residual: residual_out = bf16(x + residual), out = norm(residual_out) * weight.
// Without: out = norm(x) * weight, residual_out (if not null) = x.
extern "C" __global__ void rms_norm(bf16* out, long long out_stride, bf16* residual_out, long long residual_out_stride,
                                    const bf16* x, long long x_stride, const bf16* residual, long long residual_stride,
                                    const bf16* weight, int hidden, float eps) {
    wait_for_previous_kernel();
    const long long row = blockIdx.x;
    const int units = hidden >> 3;
    const ResidualRow input(row, x, x_stride, residual, residual_stride, residual_out, residual_out_stride);
    const FirstUnits first(weight, nullptr, units);
    uint4 values[RMS_NORM_MAX_UNITS];
    float sum_squares = 0.f;
#pragma unroll
    for (int k = 0; k < RMS_NORM_MAX_UNITS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= units) break;
        const uint4 v = input.load(i);
        float f[8];
        unpack8(v, f);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_squares += f[j] * f[j];
        values[k] = v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_squares) / (float)hidden + eps);
    const uint4* weight_units = reinterpret_cast<const uint4*>(weight);
    uint4* out_row = reinterpret_cast<uint4*>(out + row * out_stride);
#pragma unroll
    for (int k = 0; k < RMS_NORM_MAX_UNITS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= units) break;
        const uint4 v = values[k], w = k == 0 ? first.weight : weight_units[i];
        out_row[i] = make_uint4(scale_pair(v.x, w.x, inv_rms), scale_pair(v.y, w.y, inv_rms),
                                scale_pair(v.z, w.z, inv_rms), scale_pair(v.w, w.w, inv_rms));
    }
}

// A norm's input row from a linear's split-K partials (gemm.py LinearKey.splits): unit i of the linear's output is
// bf16(partial_0 + .. + partial_{splits-1} + bias) (summed in fp32 in that order, the bias added last and the sum
// rounded once, as cuBLASLt's bias epilogue rounds its accumulator), then added to the residual as ResidualRow adds
// x. partials: [splits, T, hidden] fp32, contiguous; bias may be null (no bias).
struct PartialsRow {
    const float4* partials;        // this row of partial 0
    long long split_stride;        // float4s from one partial's row to the next's
    int splits;
    const uint4* bias;
    const uint4* residual;
    uint4* residual_out;

    __device__ __forceinline__ PartialsRow(long long row, const float* partials_base, int num_rows, int hidden,
                                           int splits, const bf16* bias, const bf16* residual_base,
                                           long long residual_stride, bf16* residual_out_base,
                                           long long residual_out_stride)
        : partials(reinterpret_cast<const float4*>(partials_base + row * hidden)),
          split_stride((long long)num_rows * hidden / 4),
          splits(splits),
          bias(reinterpret_cast<const uint4*>(bias)),           // null: none
          residual(reinterpret_cast<const uint4*>(residual_base + row * residual_stride)),
          residual_out(reinterpret_cast<uint4*>(residual_out_base + row * residual_out_stride)) {}

    __device__ __forceinline__ uint4 load(int i) const {
        float a[8], b[8];
        const float4* p = partials + 2 * i;
        // Every partial's load issued before the first add (a loop over `splits` would wait for each in turn).
        float4 lo[MAX_PARTIALS], hi[MAX_PARTIALS];
#pragma unroll
        for (int s = 0; s < MAX_PARTIALS; ++s) {
            if (s < splits) {
                lo[s] = p[s * split_stride];
                hi[s] = p[s * split_stride + 1];
            }
        }
#pragma unroll
        for (int s = 1; s < MAX_PARTIALS; ++s) {
            if (s < splits) {
                lo[0].x += lo[s].x; lo[0].y += lo[s].y; lo[0].z += lo[s].z; lo[0].w += lo[s].w;
                hi[0].x += hi[s].x; hi[0].y += hi[s].y; hi[0].z += hi[s].z; hi[0].w += hi[s].w;
            }
        }
        if (bias) {
            unpack8(bias[i], b);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) b[j] = 0.f;
        }
        a[0] = lo[0].x + b[0]; a[1] = lo[0].y + b[1]; a[2] = lo[0].z + b[2]; a[3] = lo[0].w + b[3];
        a[4] = hi[0].x + b[4]; a[5] = hi[0].y + b[5]; a[6] = hi[0].z + b[6]; a[7] = hi[0].w + b[7];
        unpack8(pack8(a), a);                     // the linear's output, in bf16
        unpack8(residual[i], b);
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] += b[j];
        const uint4 v = pack8(a);
        residual_out[i] = v;
        return v;
    }
};

// LayerNorm as torch computes it for bf16 (nn.LayerNorm in M2M100 / NLLB): mean and variance in fp32 over the
// bf16 input, out = bf16((x - mean) * rstd * weight + bias) in fp32, rounded once. One block per row of `input`
// (ResidualRow or PartialsRow), each thread up to RMS_NORM_MAX_UNITS 16-byte units.
template <class Row>
__device__ __forceinline__ void layer_norm_row(const Row& input, bf16* out_row_base, const bf16* weight,
                                               const bf16* bias, int hidden, float eps) {
    const int units = hidden >> 3;
    const FirstUnits first(weight, bias, units);
    float values[RMS_NORM_MAX_UNITS][8];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < RMS_NORM_MAX_UNITS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= units) break;
        unpack8(input.load(i), values[k]);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum += values[k][j];
    }
    const float mean = block_sum(sum) / (float)hidden;
    float squares = 0.f;
#pragma unroll
    for (int k = 0; k < RMS_NORM_MAX_UNITS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= units) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) squares += (values[k][j] - mean) * (values[k][j] - mean);
    }
    const float rstd = rsqrtf(block_sum(squares) / (float)hidden + eps);
    const uint4* weight_units = reinterpret_cast<const uint4*>(weight);
    const uint4* bias_units = reinterpret_cast<const uint4*>(bias);
    uint4* out_row = reinterpret_cast<uint4*>(out_row_base);
#pragma unroll
    for (int k = 0; k < RMS_NORM_MAX_UNITS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= units) break;
        float w[8], b[8], y[8];
        unpack8(k == 0 ? first.weight : weight_units[i], w);
        unpack8(k == 0 ? first.bias : bias_units[i], b);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = (values[k][j] - mean) * rstd * w[j] + b[j];
        out_row[i] = pack8(y);
    }
}

// The layout is rms_norm's: residual_out = bf16(x + residual) where a residual is given.
extern "C" __global__ void layer_norm(bf16* out, long long out_stride, bf16* residual_out,
                                      long long residual_out_stride, const bf16* x, long long x_stride,
                                      const bf16* residual, long long residual_stride, const bf16* weight,
                                      const bf16* bias, int hidden, float eps) {
    wait_for_previous_kernel();
    const long long row = blockIdx.x;
    const ResidualRow input(row, x, x_stride, residual, residual_stride, residual_out, residual_out_stride);
    layer_norm_row(input, out + row * out_stride, weight, bias, hidden, eps);
}

// LayerNorm over rows gathered by index: x = x_table[x_rows[row]] plus residual = residual_table[residual_rows[row]]
// (an embedding layer's token and position lookups, which two gather_rows launches would copy), residual_out =
// bf16(x + residual), out = norm(residual_out): layer_norm's arithmetic over the rows gather_rows would give. An
// index outside its table reads a zero row (x), or adds nothing (residual: the same sum but for a negative zero).
extern "C" __global__ void layer_norm_gathered(bf16* out, long long out_stride, bf16* residual_out,
                                               long long residual_out_stride, const bf16* x_table, long long x_stride,
                                               const int* x_rows, int x_table_rows, const bf16* residual_table,
                                               long long residual_stride, const int* residual_rows,
                                               int residual_table_rows, const bf16* weight, const bf16* bias,
                                               int hidden, float eps) {
    wait_for_previous_kernel();
    const long long row = blockIdx.x;
    const int x_index = x_rows[row], residual_index = residual_rows[row];
    const bool x_inside = x_index >= 0 && x_index < x_table_rows;
    const bool residual_inside = residual_index >= 0 && residual_index < residual_table_rows;
    const ResidualRow input(
        x_inside ? reinterpret_cast<const uint4*>(x_table + x_index * x_stride) : nullptr,
        residual_inside ? reinterpret_cast<const uint4*>(residual_table + residual_index * residual_stride) : nullptr,
        reinterpret_cast<uint4*>(residual_out + row * residual_out_stride));
    layer_norm_row(input, out + row * out_stride, weight, bias, hidden, eps);
}

// LayerNorm over residual + a linear's output given as split-K partials (PartialsRow): residual_out = bf16(residual
// + bf16(sum of partials + linear_bias)), out = norm(residual_out). partials [splits, num_rows, hidden] fp32.
extern "C" __global__ void layer_norm_partials(bf16* out, long long out_stride, bf16* residual_out,
                                               long long residual_out_stride, const float* partials, int num_rows,
                                               int splits, const bf16* linear_bias, const bf16* residual,
                                               long long residual_stride, const bf16* weight, const bf16* bias,
                                               int hidden, float eps) {
    wait_for_previous_kernel();
    const long long row = blockIdx.x;
    const PartialsRow input(row, partials, num_rows, hidden, splits, linear_bias, residual, residual_stride,
                            residual_out, residual_out_stride);
    layer_norm_row(input, out + row * out_stride, weight, bias, hidden, eps);
}

// In place over x [T, num_heads * head_dim] bf16 (row stride in elements, may be a column slice of qkv),
// weight [head_dim]; one warp per (row, head), blocks of HEAD_NORM_WARPS warps. head_dim even, <= 256;
// rows 4-byte aligned.
extern "C" __global__ void head_rms_norm(bf16* x, long long x_stride, const bf16* weight, int num_rows, int num_heads,
                                         int head_dim, float eps) {
    wait_for_previous_kernel();
    const long long item = (long long)blockIdx.x * HEAD_NORM_WARPS + (threadIdx.x >> 5);
    if (item >= (long long)num_rows * num_heads) return;
    const int lane = threadIdx.x & 31;
    const long long row = item / num_heads;
    const int head = (int)(item % num_heads);
    unsigned int* head_pairs = reinterpret_cast<unsigned int*>(x + row * x_stride + (long long)head * head_dim);
    const unsigned int* weight_pairs = reinterpret_cast<const unsigned int*>(weight);
    const int pairs = head_dim >> 1;
    unsigned int values[HEAD_NORM_MAX_UNITS];
    float sum_squares = 0.f;
#pragma unroll
    for (int k = 0; k < HEAD_NORM_MAX_UNITS; ++k) {
        const int i = lane + 32 * k;
        if (i < pairs) {
            values[k] = head_pairs[i];
            const float2 f = bf16x2_to_float2(values[k]);
            sum_squares += f.x * f.x + f.y * f.y;
        }
    }
    const float inv_rms = rsqrtf(warp_sum(sum_squares) / (float)head_dim + eps);
#pragma unroll
    for (int k = 0; k < HEAD_NORM_MAX_UNITS; ++k) {
        const int i = lane + 32 * k;
        if (i < pairs) head_pairs[i] = scale_pair(values[k], weight_pairs[i], inv_rms);
    }
}
