"""The persistent-kernel prototype of an M2M100 decoder layer's decode step (gpu_persistent_layer.py): its CUDA
source, 12 phases a layer over persistent_kernels.py's linear parts, and the host's packing of its Layer record."""

import numpy as np

from bench.persistent_kernels import PHASE_DTYPE, PHASE_PARTS

DECODER_LAYERS = PHASE_PARTS + r"""
constexpr int HIDDEN = 1024, FFN = 4096, HEADS = 16, HEAD_DIM = 64, BEAMS = 4, WARPS = THREADS / 32;
constexpr int MAX_FC1_SLICES = 4;
constexpr int QKV = 0, OUT = 1, CROSS_Q = 2, CROSS_OUT = 3, FC1 = 4, FC2 = 5, LINEARS = 6;

// Everything the layer reads and writes; every field 8 bytes (the host packs it as int64 / uint64 / float64).
struct Layer {
    Phase linear[LINEARS];
    const bf16* bias[LINEARS];
    const bf16* norm_weight[3];
    const bf16* norm_bias[3];
    bf16* h;                    // [ROWS, HIDDEN] a norm's output: the next linear's x
    bf16* o;                    // [ROWS, HIDDEN] an attention's output
    bf16* f;                    // [ROWS, FFN] bf16(relu(fc1's output)): fc2's x
    bf16* residual;             // [ROWS, HIDDEN]
    bf16* self_k;               // [ROWS, max_positions, HIDDEN]; the new token's at position context - 1
    bf16* self_v;
    const bf16* cross_k;        // [ROWS / BEAMS, source, HIDDEN]
    const bf16* cross_v;
    unsigned int* counter;
    long long max_positions, context, source;
    double scale_log2, eps;
};

static_assert(sizeof(Layer) == 496, "the host packs Layer in 496 bytes (LAYER_FIELDS)");

__device__ __forceinline__ float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// bf16(sum of a linear's partials in slice order + its bias) at (row, column): as cuBLASLt's bias epilogue
// rounds, and as layer_norm_partials and the partial-query attention sum them.
__device__ __forceinline__ float linear_output(const Phase& p, const bf16* bias, int row, int column) {
    float sum = 0.f;
    const int slices = p.k / p.k_slice;
    for (int s = 0; s < slices; ++s) sum += p.partial[((long long)s * ROWS + row) * p.n + column];
    return round_bf16(sum + bf16_to_float(bias[column]));
}

// Rows 0..ROWS-1 on CTAs 0..ROWS-1: residual = bf16(residual + linear's output); h = LayerNorm(residual).
__device__ void norm_phase(const Layer& L, int linear, int norm) {
    if (blockIdx.x >= ROWS) return;
    constexpr int PER = HIDDEN / THREADS;
    const int row = blockIdx.x;
    float r[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int column = threadIdx.x + THREADS * i;
        const float t = linear_output(L.linear[linear], L.bias[linear], row, column);
        r[i] = round_bf16(bf16_to_float(L.residual[row * HIDDEN + column]) + t);
        L.residual[row * HIDDEN + column] = float_to_bf16(r[i]);
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) sum += r[i];
    const float mean = block_sum(sum) / HIDDEN;
    float squares = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) squares += (r[i] - mean) * (r[i] - mean);
    const float inv = rsqrtf(block_sum(squares) / HIDDEN + (float)L.eps);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int column = threadIdx.x + THREADS * i;
        L.h[row * HIDDEN + column] = float_to_bf16((r[i] - mean) * inv * bf16_to_float(L.norm_weight[norm][column])
                                                   + bf16_to_float(L.norm_bias[norm][column]));
    }
}

// One warp per (row, head), CTAs x WARPS of them. The query (and, for self-attention, the new key and value) from
// the linear's partials; keys 0 .. keys - 1 of `k`/`v` (row stride in elements), the new token (self) last. Each
// lane takes key lane (+ 32), two dims of the output.
__device__ void attention_phase(const Layer& L, bool self) {
    __shared__ __align__(16) float query[WARPS][HEAD_DIM];
    __shared__ __align__(16) float new_key[WARPS][HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int item = blockIdx.x * WARPS + warp;
    if (item >= ROWS * HEADS) return;
    const int row = item / HEADS, head = item % HEADS, column = head * HEAD_DIM;
    const Phase& q_linear = L.linear[self ? QKV : CROSS_Q];
    const bf16* q_bias = L.bias[self ? QKV : CROSS_Q];
    const int keys = self ? (int)L.context : (int)L.source;
    const long long base = self ? (long long)row * L.max_positions : (long long)(row / BEAMS) * L.source;
    const bf16* k = (self ? L.self_k : L.cross_k) + base * HIDDEN + column;
    const bf16* v = (self ? L.self_v : L.cross_v) + base * HIDDEN + column;
    float new_value[2] = {0.f, 0.f};
    for (int d = lane; d < HEAD_DIM; d += 32) {
        query[warp][d] = linear_output(q_linear, q_bias, row, column + d) * (float)L.scale_log2;
        if (self) {
            const float key = linear_output(q_linear, q_bias, row, HIDDEN + column + d);
            new_key[warp][d] = key;
            L.self_k[((long long)row * L.max_positions + keys - 1) * HIDDEN + column + d] = float_to_bf16(key);
        }
    }
    if (self) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int d = 2 * lane + i;
            new_value[i] = linear_output(q_linear, q_bias, row, 2 * HIDDEN + column + d);
            L.self_v[((long long)row * L.max_positions + keys - 1) * HIDDEN + column + d] = float_to_bf16(new_value[i]);
        }
    }
    __syncwarp();
    const int fresh = self ? keys - 1 : -1;         // the new token's key, not read from the cache
    float running_max = -__int_as_float(0x7f800000), sum = 0.f, acc[2] = {0.f, 0.f};
    for (int first = 0; first < keys; first += 32) {
        const int key = first + lane;
        float score = -__int_as_float(0x7f800000);
        if (key < keys) {
            float dot = 0.f;
            for (int d = 0; d < HEAD_DIM; d += 2) {
                const float2 kv = key == fresh ? make_float2(new_key[warp][d], new_key[warp][d + 1])
                                               : bf16x2_to_float2(*reinterpret_cast<const unsigned*>(
                                                     k + (long long)key * HIDDEN + d));
                dot += query[warp][d] * kv.x + query[warp][d + 1] * kv.y;
            }
            score = dot;
        }
        const float new_max = fmaxf(running_max, warp_max(score));
        const float rescale = exp2f(running_max - new_max), p = exp2f(score - new_max);
        sum = sum * rescale + warp_sum(p);
        acc[0] *= rescale;
        acc[1] *= rescale;
        running_max = new_max;
        const int count = min(32, keys - first);
        for (int j = 0; j < count; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const int key_j = first + j;
            const float2 value = key_j == fresh ? make_float2(new_value[0], new_value[1])
                                                : bf16x2_to_float2(*reinterpret_cast<const unsigned*>(
                                                      v + (long long)key_j * HIDDEN + 2 * lane));
            acc[0] += pj * value.x;
            acc[1] += pj * value.y;
        }
    }
    *reinterpret_cast<unsigned*>(L.o + (long long)row * HIDDEN + column + 2 * lane) =
        float2_to_bf16x2(acc[0] / sum, acc[1] / sum);
}

// f = bf16(relu(fc1's output)), [ROWS, FFN], spread over the CTAs: fc2's x, which each of its CTAs then loads a
// slice of (summing fc1's partials in fc2's loader instead would read 64 rows x its slice x every partial a CTA).
__device__ void relu_phase(const Layer& L) {
    const Phase& p = L.linear[FC1];
    const int per_cta = ROWS * FFN / gridDim.x, slices = p.k / p.k_slice;
    for (int i = blockIdx.x * per_cta + threadIdx.x * 8; i < (blockIdx.x + 1) * per_cta; i += THREADS * 8) {
        const int row = i / FFN, column = i % FFN;
        float4 part[MAX_FC1_SLICES][2];
#pragma unroll
        for (int s = 0; s < MAX_FC1_SLICES; ++s) {
            if (s < slices) {
                const float4* at =
                    reinterpret_cast<const float4*>(p.partial + ((long long)s * ROWS + row) * FFN + column);
                part[s][0] = at[0];
                part[s][1] = at[1];
            }
        }
        const uint4 bias = *reinterpret_cast<const uint4*>(L.bias[FC1] + column);
        float value[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < MAX_FC1_SLICES; ++s) {
            if (s < slices) {
                value[0] += part[s][0].x; value[1] += part[s][0].y; value[2] += part[s][0].z; value[3] += part[s][0].w;
                value[4] += part[s][1].x; value[5] += part[s][1].y; value[6] += part[s][1].z; value[7] += part[s][1].w;
            }
        }
        const unsigned words[4] = {bias.x, bias.y, bias.z, bias.w};
        unsigned packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 b = bf16x2_to_float2(words[j]);
            packed[j] = float2_to_bf16x2(fmaxf(round_bf16(value[2 * j] + b.x), 0.f),
                                         fmaxf(round_bf16(value[2 * j + 1] + b.y), 0.f));
        }
        *reinterpret_cast<uint4*>(L.f + (long long)row * FFN + column) = make_uint4(packed[0], packed[1], packed[2],
                                                                                    packed[3]);
    }
}

// Linear `index` of layer `layer` (the `step`-th linear of the launch): x's slice (h, o, or f for fc2) and the
// tile prefetched during the linear before; the next linear's tile goes out now.
__device__ void linear_phase(const Layer& L, int index, int layer, int step, int steps, unsigned char* shared) {
    const Phase& p = L.linear[index];
    bf16* xs = reinterpret_cast<bf16*>(shared + 2 * TILE_BYTES);
    bf16* ws = reinterpret_cast<bf16*>(shared + (step & 1) * TILE_BYTES);
    const int k0 = tile_k_block(p) * p.k_slice;
    if (index == FC2) load_tile(xs, L.f + k0, FFN, ROWS, p.k_slice);
    else load_tile(xs, (index == QKV || index == CROSS_Q || index == FC1 ? L.h : L.o) + k0, HIDDEN, ROWS, p.k_slice);
    copy_async_commit();
    if (step + 1 < steps) {
        const int next = (index + 1) % LINEARS;
        load_weight_tile(reinterpret_cast<bf16*>(shared + ((step + 1) & 1) * TILE_BYTES), L.linear[next],
                         next == 0 ? layer + 1 : layer);
    }
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();
    multiply_tile(p, xs, ws);
}

// `layers` decoder layers in a row, layer i on weight copy i; the first norm takes the partials fc2 left.
extern "C" __global__ void __launch_bounds__(THREADS, 1) decoder_layers(const Layer* layer_, int layers) {
    extern __shared__ __align__(128) unsigned char shared[];
    const Layer& L = *layer_;
    unsigned int target = 0;
    const auto barrier = [&]() { grid_barrier<true>(L.counter, target += gridDim.x); };
    load_weight_tile(reinterpret_cast<bf16*>(shared), L.linear[QKV], 0);
    copy_async_commit();
    const int steps = layers * LINEARS;
    for (int layer = 0; layer < layers; ++layer) {
        const int step = layer * LINEARS;
        norm_phase(L, FC2, 0);                                        barrier();
        linear_phase(L, QKV, layer, step, steps, shared);             barrier();
        attention_phase(L, true);                                     barrier();
        linear_phase(L, OUT, layer, step + 1, steps, shared);         barrier();
        norm_phase(L, OUT, 1);                                        barrier();
        linear_phase(L, CROSS_Q, layer, step + 2, steps, shared);     barrier();
        attention_phase(L, false);                                    barrier();
        linear_phase(L, CROSS_OUT, layer, step + 3, steps, shared);   barrier();
        norm_phase(L, CROSS_OUT, 2);                                  barrier();
        linear_phase(L, FC1, layer, step + 4, steps, shared);         barrier();
        relu_phase(L);                                                barrier();
        linear_phase(L, FC2, layer, step + 5, steps, shared);         barrier();
    }
}
"""

LAYER_FIELDS = ([(f"linear{i}_{name}", dtype) for i in range(6) for name, dtype in PHASE_DTYPE.descr]
                + [(f"bias{i}", np.uint64) for i in range(6)] + [(f"norm_weight{i}", np.uint64) for i in range(3)]
                + [(f"norm_bias{i}", np.uint64) for i in range(3)]
                + [(name, np.uint64) for name in ("h", "o", "f", "residual", "self_k", "self_v", "cross_k",
                                                  "cross_v", "counter")]
                + [(name, np.int64) for name in ("max_positions", "context", "source")]
                + [(name, np.float64) for name in ("scale_log2", "eps")])
LAYER_BYTES = 496           # sizeof(Layer), as the kernel's static_assert says
