// Mamba2's causal conv and selective scan over each segment's recurrent state (cache/specs.RecurrentState), and
// its gated RMSNorm. Activations are bf16 with row strides in elements; states are float32, [slots, ...]
// contiguous. A segment's tokens are rows seg_starts[s] .. + seg_lens[s] - 1 of the batch; its state is read from
// slot sources[s] (-1: zeros) and written to slot destinations[s] (-1: not kept, a graph's padding row), which may
// be the same slot (every read of a slot comes before the writes to it, in one thread or in an earlier launch) but
// is no other segment's source.
#include "common.cuh"

#define SSM_MAX_CONV_KERNEL 8       // conv_kernel <= 8 (4 in every released model)
#define SSM_CONV_TOKENS 16          // tokens one thread convolves, for one channel
#define SSM_SCAN_LANES 8            // threads sharing one row p of a head's state, each state_size / 8 columns
#define SSM_MAX_STATE_PER_LANE 32   // state_size <= 256

__device__ __forceinline__ float ssm_silu(float x) { return x / (1.f + expf(-x)); }

// torch.nn.functional.softplus (beta 1, threshold 20).
__device__ __forceinline__ float ssm_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// out[t][c] = silu(bias[c] + sum_k weight[c][k] * in(t - (K - 1) + k)), in(j) = x[start + j][c] for j >= 0, else
// the conv state's column K - 1 + j ([slots, C, K - 1], oldest first). Grid: (ceil(C / blockDim.x), segments,
// ceil(longest segment / SSM_CONV_TOKENS)); each thread one channel over SSM_CONV_TOKENS tokens.
extern "C" __global__ void ssm_conv(bf16* out, long long out_stride, const bf16* x, long long x_stride,
                                    const bf16* weight, const bf16* bias, const float* conv_state,
                                    const int* seg_starts, const int* seg_lens, const int* sources, int channels,
                                    int kernel_width) {
    wait_for_previous_kernel();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y, len = seg_lens[s], t0 = blockIdx.z * SSM_CONV_TOKENS;
    if (c >= channels || t0 >= len) return;
    const int start = seg_starts[s], source = sources[s], history = kernel_width - 1;
    float w[SSM_MAX_CONV_KERNEL], window[SSM_MAX_CONV_KERNEL];
    for (int k = 0; k < kernel_width; ++k) w[k] = bf16_to_float(weight[(long long)c * kernel_width + k]);
    for (int k = 0; k < history; ++k) {      // window[k] = in(t0 - history + k)
        const int j = t0 - history + k;
        window[k] = j >= 0 ? bf16_to_float(x[(long long)(start + j) * x_stride + c])
                  : source >= 0 ? conv_state[((long long)source * channels + c) * history + history + j] : 0.f;
    }
    const float b = bias ? bf16_to_float(bias[c]) : 0.f;
    const int t1 = min(len, t0 + SSM_CONV_TOKENS);
    for (int t = t0; t < t1; ++t) {
        window[history] = bf16_to_float(x[(long long)(start + t) * x_stride + c]);
        float y = b;
        for (int k = 0; k < kernel_width; ++k) y += w[k] * window[k];
        out[(long long)(start + t) * out_stride + c] = float_to_bf16(ssm_silu(y));
        for (int k = 0; k < history; ++k) window[k] = window[k + 1];
    }
}

// The conv state after each segment: its last K - 1 inputs, oldest first, from the state before it where the
// segment is shorter. Launched after ssm_conv (which reads the state before). Grid: (ceil(C / blockDim.x),
// segments).
extern "C" __global__ void ssm_conv_state(float* conv_state, const bf16* x, long long x_stride, const int* seg_starts,
                                          const int* seg_lens, const int* sources, const int* destinations,
                                          int channels, int kernel_width) {
    wait_for_previous_kernel();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= channels || destinations[s] < 0) return;
    const int start = seg_starts[s], len = seg_lens[s], source = sources[s], history = kernel_width - 1;
    float kept[SSM_MAX_CONV_KERNEL];
    for (int k = 0; k < history; ++k) {
        const int j = len - history + k;
        kept[k] = j >= 0 ? bf16_to_float(x[(long long)(start + j) * x_stride + c])
                : source >= 0 ? conv_state[((long long)source * channels + c) * history + history + j] : 0.f;
    }
    float* row = conv_state + ((long long)destinations[s] * channels + c) * history;
    for (int k = 0; k < history; ++k) row[k] = kept[k];
}

// The selective scan of each segment, a token at a time, for one head: thread (p, lane) keeps row p of the head's
// state [head_dim, state_size], columns lane, lane + 8, ..., in registers. Per token, with step =
// clamp(softplus(dt + dt_bias), dt_min, dt_max): h = h * exp(step * A) + step * x[p] * B, and
// y[p] = h . C + D * x[p]. xbc [T, inner + 2 * n_groups * state_size] holds x, then B and C of every group; heads
// share their group's. Grid: (heads, segments); block: head_dim * SSM_SCAN_LANES threads.
extern "C" __global__ void ssm_scan(bf16* y, long long y_stride, const bf16* xbc, long long xbc_stride, const bf16* dt,
                                    long long dt_stride, const float* A, const float* D, const float* dt_bias,
                                    float* ssm_state, const int* seg_starts, const int* seg_lens, const int* sources,
                                    const int* destinations, int num_heads, int head_dim, int n_groups,
                                    int state_size, float dt_min, float dt_max) {
    wait_for_previous_kernel();
    const int head = blockIdx.x, s = blockIdx.y;
    const int p = threadIdx.x / SSM_SCAN_LANES, lane = threadIdx.x % SSM_SCAN_LANES;
    const int per_lane = state_size / SSM_SCAN_LANES, inner = num_heads * head_dim;
    const int start = seg_starts[s], len = seg_lens[s], source = sources[s];
    const int group = head / (num_heads / n_groups);
    const long long slot_size = (long long)num_heads * head_dim * state_size;
    const long long row_offset = ((long long)head * head_dim + p) * state_size;
    float h[SSM_MAX_STATE_PER_LANE];
    for (int i = 0; i < per_lane; ++i)
        h[i] = source >= 0 ? ssm_state[source * slot_size + row_offset + lane + i * SSM_SCAN_LANES] : 0.f;
    const float a = A[head], d = D[head], bias = dt_bias[head];
    for (int t = 0; t < len; ++t) {
        const long long row = start + t;
        const float step = fminf(fmaxf(ssm_softplus(bf16_to_float(dt[row * dt_stride + head]) + bias), dt_min), dt_max);
        const float decay = expf(step * a);
        const bf16* token = xbc + row * xbc_stride;
        const float xv = bf16_to_float(token[head * head_dim + p]);
        const bf16* B = token + inner + group * state_size;
        const bf16* C = B + n_groups * state_size;
        float partial = 0.f;
        for (int i = 0; i < per_lane; ++i) {
            const int n = lane + i * SSM_SCAN_LANES;
            h[i] = h[i] * decay + step * xv * bf16_to_float(B[n]);
            partial += h[i] * bf16_to_float(C[n]);
        }
#pragma unroll
        for (int offset = SSM_SCAN_LANES / 2; offset > 0; offset >>= 1)
            partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        if (lane == 0) y[row * y_stride + head * head_dim + p] = float_to_bf16(partial + d * xv);
    }
    if (destinations[s] < 0) return;
    float* out_state = ssm_state + destinations[s] * slot_size + row_offset;
    for (int i = 0; i < per_lane; ++i) out_state[lane + i * SSM_SCAN_LANES] = h[i];
}

// Mamba2's RMSNorm over each group_size slice of a row, with the gate: norm_before_gate 0 (Mamba2, Nemotron-H,
// Granite): h = x * silu(gate) in fp32, out = bf16(weight * bf16(h * rsqrt(mean(h^2) + eps))), as transformers'
// MambaRMSNormGated in bf16; 1 (Falcon-H1): out = bf16(weight * x * rsqrt(mean(x^2) + eps) * silu(gate)), all in
// fp32. Grid: (groups, rows); block: a multiple of 32.
extern "C" __global__ void ssm_gated_norm(bf16* out, long long out_stride, const bf16* x, long long x_stride,
                                          const bf16* gate, long long gate_stride, const bf16* weight,
                                          int group_size, float eps, int norm_before_gate) {
    wait_for_previous_kernel();
    const long long row = blockIdx.y;
    const int base = blockIdx.x * group_size;
    const bf16* xr = x + row * x_stride + base;
    const bf16* gr = gate + row * gate_stride + base;
    float sum = 0.f;
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
        float v = bf16_to_float(xr[i]);
        if (!norm_before_gate) v *= ssm_silu(bf16_to_float(gr[i]));
        sum += v * v;
    }
    const float inv = rsqrtf(block_sum(sum) / group_size + eps);
    bf16* orow = out + row * out_stride + base;
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
        const float g = ssm_silu(bf16_to_float(gr[i])), w = bf16_to_float(weight[base + i]);
        const float v = bf16_to_float(xr[i]);
        orow[i] = norm_before_gate ? float_to_bf16(w * v * inv * g)
                                   : float_to_bf16(w * bf16_to_float(float_to_bf16(v * g * inv)));
    }
}

// Copies whole state slots (a fork's, a snapshot's): for each state tensor i (base address bases[i], slot_words[i]
// 16-byte words a slot) and each copy j, slot copies[j][0] to slot copies[j][1]. Grid: (ceil(largest slot's words /
// blockDim.x / SSM_COPY_WORDS), tensors, copies).
#define SSM_COPY_WORDS 4
extern "C" __global__ void ssm_copy_slots(const unsigned long long* bases, const long long* slot_words,
                                          const int* copies) {
    wait_for_previous_kernel();
    const long long words = slot_words[blockIdx.y];
    uint4* base = reinterpret_cast<uint4*>(bases[blockIdx.y]);
    const uint4* src = base + copies[2 * blockIdx.z] * words;
    uint4* dst = base + copies[2 * blockIdx.z + 1] * words;
    for (long long w = ((long long)blockIdx.x * SSM_COPY_WORDS) * blockDim.x + threadIdx.x, k = 0;
         k < SSM_COPY_WORDS && w < words; ++k, w += blockDim.x)
        dst[w] = src[w];
}
