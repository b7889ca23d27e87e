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
        out[(long long)(start + t) * out_stride + c] = float_to_bf16(silu(y));
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

// The selective scan of one segment, a token at a time, for one head: thread (p, lane) keeps row p of the head's
// state [head_dim, state_size], columns lane, lane + 8, ..., in registers (interleaved: a warp's loads of B, C and
// the state are then consecutive bytes, which measured faster from global memory than each thread's columns side
// by side). Per token, with step = clamp(softplus(dt + dt_bias), dt_min, dt_max): h = h * exp(step * A) + step *
// x[p] * B, and y[p] = h . C + D * x[p]. The next token's dt, x, B and C are loaded before the current token's
// update.
template <int PER_LANE>
__device__ __forceinline__ void ssm_scan_segment(const bf16* xbc, long long xbc_stride, const bf16* dt,
                                                 long long dt_stride, bf16* y, long long y_stride, float a, float d,
                                                 float bias, float* ssm_state, int start, int len, int source,
                                                 int destination, int num_heads, int head_dim, int n_groups,
                                                 float dt_min, float dt_max) {
    const int head = blockIdx.x, p = threadIdx.x / SSM_SCAN_LANES, lane = threadIdx.x % SSM_SCAN_LANES;
    const int state_size = PER_LANE * SSM_SCAN_LANES, inner = num_heads * head_dim;
    const int group = head / (num_heads / n_groups);
    const long long slot_size = (long long)num_heads * head_dim * state_size;
    const long long row_offset = ((long long)head * head_dim + p) * state_size + lane;
    float h[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
        h[i] = source >= 0 ? ssm_state[source * slot_size + row_offset + i * SSM_SCAN_LANES] : 0.f;
    float B[PER_LANE], C[PER_LANE], raw = 0.f, xv = 0.f;
    auto load = [&](long long row) {
        const bf16* token = xbc + row * xbc_stride;
        raw = bf16_to_float(dt[row * dt_stride + head]);
        xv = bf16_to_float(token[head * head_dim + p]);
        const bf16* Bg = token + inner + group * state_size + lane;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            B[i] = bf16_to_float(Bg[i * SSM_SCAN_LANES]);
            C[i] = bf16_to_float(Bg[n_groups * state_size + i * SSM_SCAN_LANES]);
        }
    };
    if (len > 0) load(start);
    for (int t = 0; t < len; ++t) {
        const long long row = start + t;
        const float step = fminf(fmaxf(ssm_softplus(raw + bias), dt_min), dt_max);
        const float decay = expf(step * a), dx = step * xv, x_now = xv;
        float partial = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            h[i] = h[i] * decay + dx * B[i];
            partial += h[i] * C[i];
        }
        if (t + 1 < len) load(row + 1);
#pragma unroll
        for (int offset = SSM_SCAN_LANES / 2; offset > 0; offset >>= 1)
            partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        if (lane == 0) y[row * y_stride + head * head_dim + p] = float_to_bf16(partial + d * x_now);
    }
    if (destination < 0) return;
    float* out_state = ssm_state + destination * slot_size + row_offset;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) out_state[i * SSM_SCAN_LANES] = h[i];
}

// ssm_scan_segment over every segment. xbc [T, inner + 2 * n_groups * state_size] holds x, then B and C of every
// group; heads share their group's. Grid: (heads, segments); block: head_dim * SSM_SCAN_LANES threads; state_size
// in 16, 32, ..., 256 (its registers a thread, a compile-time count).
extern "C" __global__ void __launch_bounds__(1024)
ssm_scan(bf16* y, long long y_stride, const bf16* xbc, long long xbc_stride, const bf16* dt, long long dt_stride,
         const float* A, const float* D, const float* dt_bias, int num_heads, int head_dim, int n_groups,
         int state_size, float dt_min, float dt_max, float* ssm_state, const int* seg_starts, const int* seg_lens,
         const int* sources, const int* destinations) {
    wait_for_previous_kernel();
    const int head = blockIdx.x, s = blockIdx.y;
#define SSM_SCAN_SEGMENT(K) ssm_scan_segment<K>(xbc, xbc_stride, dt, dt_stride, y, y_stride, A[head], D[head],         \
        dt_bias[head], ssm_state, seg_starts[s], seg_lens[s], sources[s], destinations[s], num_heads, head_dim,     \
        n_groups, dt_min, dt_max)
    switch (state_size / SSM_SCAN_LANES) {
        case 2: SSM_SCAN_SEGMENT(2); break;
        case 4: SSM_SCAN_SEGMENT(4); break;
        case 8: SSM_SCAN_SEGMENT(8); break;
        case 16: SSM_SCAN_SEGMENT(16); break;
        case 32: SSM_SCAN_SEGMENT(32); break;
    }
#undef SSM_SCAN_SEGMENT
}

// The chunked scan of long segments (a prefill's), in three launches: every chunk of chunk_size tokens at once
// (pass 0: from a zero state, its end state into chunk_states and its summed step * A into chunk_decays), then the
// states carried across each segment's chunks (ssm_chunk_carry: chunk_states becomes each chunk's entering state, the
// last one's end state goes to the destination slot), then every chunk at once again (pass 1: from its entering
// state, y). Segment s's chunk c uses workspace slot start / chunk_size + s + c: distinct for segments in row order.
// Within a chunk the recurrence is ssm_scan's, with SSM_STAGE tokens at a time staged in shared memory (coalesced
// loads; the recurrence then waits on shared memory, not on HBM) and the state in PER_LANE = state_size / 8
// registers a thread: here each thread's columns side by side, so that B and C come from shared memory in vector
// loads (a quarter of the shared-memory wavefronts of ssm_scan's interleaved columns).
#define SSM_STAGE 32
struct SsmScanArgs {
    bf16* y; long long y_stride; const bf16* xbc; long long xbc_stride; const bf16* dt; long long dt_stride;
    const float* A; const float* D; const float* dt_bias; int num_heads, head_dim, n_groups, state_size;
    float dt_min, dt_max;
};

// The staged tokens (declared once per kernel: each PER_LANE instantiation shares them).
struct alignas(16) SsmStage {
    bf16 x[SSM_STAGE * 128], b[SSM_STAGE * 256], c[SSM_STAGE * 256];
    float step[SSM_STAGE];
};

// A thread's PER_LANE consecutive state columns of a staged bf16 row (B or C of one token) as floats, in vector
// loads of up to 8 bf16 (the stage is 16-byte aligned; a thread's columns start at a multiple of PER_LANE).
template <int PER_LANE>
__device__ __forceinline__ void ssm_load_columns(float (&to)[PER_LANE], const bf16* from) {
    constexpr int V = PER_LANE < 8 ? PER_LANE : 8;
    struct alignas(2 * V) Pack { bf16 v[V]; };
#pragma unroll
    for (int i = 0; i < PER_LANE; i += V) {
        const Pack pack = *reinterpret_cast<const Pack*>(from + i);
#pragma unroll
        for (int k = 0; k < V; ++k) to[i + k] = bf16_to_float(pack.v[k]);
    }
}

// One thread's PER_LANE consecutive fp32 state columns, from or to memory, in vectors of up to 4 (state rows are
// 16-byte aligned: state_size is a multiple of 16; a thread's columns start at a multiple of PER_LANE).
template <int PER_LANE>
struct SsmStatePack {
    static constexpr int V = PER_LANE < 4 ? PER_LANE : 4;
    struct alignas(4 * V) Pack { float v[V]; };
};

template <int PER_LANE>
__device__ __forceinline__ void ssm_read_state(float (&h)[PER_LANE], const float* from) {
    using Pack = typename SsmStatePack<PER_LANE>::Pack;
    constexpr int V = SsmStatePack<PER_LANE>::V;
#pragma unroll
    for (int i = 0; i < PER_LANE; i += V) {
        const Pack pack = *reinterpret_cast<const Pack*>(from + i);
#pragma unroll
        for (int k = 0; k < V; ++k) h[i + k] = pack.v[k];
    }
}

template <int PER_LANE>
__device__ __forceinline__ void ssm_write_state(float* to, const float (&h)[PER_LANE]) {
    using Pack = typename SsmStatePack<PER_LANE>::Pack;
    constexpr int V = SsmStatePack<PER_LANE>::V;
#pragma unroll
    for (int i = 0; i < PER_LANE; i += V) {
        Pack pack;
#pragma unroll
        for (int k = 0; k < V; ++k) pack.v[k] = h[i + k];
        *reinterpret_cast<Pack*>(to + i) = pack;
    }
}

// Tokens [start, start + count) of the batch for one head, from h; y written where given. Returns the sum of
// step * A over the tokens.
template <int PER_LANE>
__device__ __forceinline__ float ssm_scan_tokens(const SsmScanArgs& g, SsmStage& stage, float (&h)[PER_LANE],
                                                 int head, long long start, int count) {
    const int p = threadIdx.x / SSM_SCAN_LANES, lane = threadIdx.x % SSM_SCAN_LANES;
    const int inner = g.num_heads * g.head_dim, n = PER_LANE * SSM_SCAN_LANES;
    const int group = head / (g.num_heads / g.n_groups);
    const float a = g.A[head], d = g.D[head], bias = g.dt_bias[head];
    float decay_sum = 0.f;
    for (int t0 = 0; t0 < count; t0 += SSM_STAGE) {
        const int staged = min(SSM_STAGE, count - t0);
        __syncthreads();                    // the stage before is consumed
        for (int i = threadIdx.x; i < staged * g.head_dim; i += blockDim.x) {
            const int t = i / g.head_dim, q = i % g.head_dim;
            stage.x[i] = g.xbc[(start + t0 + t) * g.xbc_stride + head * g.head_dim + q];
        }
        for (int i = threadIdx.x; i < staged * n; i += blockDim.x) {
            const int t = i / n, q = i % n;
            const bf16* B = g.xbc + (start + t0 + t) * g.xbc_stride + inner + group * n;
            stage.b[i] = B[q];
            stage.c[i] = B[g.n_groups * n + q];
        }
        for (int t = threadIdx.x; t < staged; t += blockDim.x) {
            const float raw = bf16_to_float(g.dt[(start + t0 + t) * g.dt_stride + head]);
            stage.step[t] = fminf(fmaxf(ssm_softplus(raw + bias), g.dt_min), g.dt_max);
        }
        __syncthreads();
        for (int t = 0; t < staged; ++t) {
            const float step = stage.step[t], decay = expf(step * a);
            const float xv = bf16_to_float(stage.x[t * g.head_dim + p]), dx = step * xv;
            float B[PER_LANE], C[PER_LANE];
            ssm_load_columns<PER_LANE>(B, stage.b + t * n + lane * PER_LANE);
            ssm_load_columns<PER_LANE>(C, stage.c + t * n + lane * PER_LANE);
            decay_sum += step * a;
            float partial = 0.f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                h[i] = h[i] * decay + dx * B[i];
                partial += h[i] * C[i];
            }
            if (g.y == nullptr) continue;
#pragma unroll
            for (int offset = SSM_SCAN_LANES / 2; offset > 0; offset >>= 1)
                partial += __shfl_xor_sync(0xffffffffu, partial, offset);
            if (lane == 0) g.y[(start + t0 + t) * g.y_stride + head * g.head_dim + p] = float_to_bf16(partial + d * xv);
        }
    }
    return decay_sum;
}

template <int PER_LANE>
__device__ __forceinline__ void ssm_scan_chunk(const SsmScanArgs& g, SsmStage& stage, float* chunk_states,
                                               float* chunk_decays, long long slot, int start, int count, int pass) {
    const int head = blockIdx.x, p = threadIdx.x / SSM_SCAN_LANES, lane = threadIdx.x % SSM_SCAN_LANES;
    float* state = chunk_states + slot * g.num_heads * g.head_dim * g.state_size
                 + ((long long)head * g.head_dim + p) * g.state_size + lane * PER_LANE;
    float h[PER_LANE];
    if (pass) ssm_read_state<PER_LANE>(h, state);
    else {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) h[i] = 0.f;
    }
    const float decay_sum = ssm_scan_tokens<PER_LANE>(g, stage, h, head, start, count);
    if (pass) return;
    ssm_write_state<PER_LANE>(state, h);
    if (threadIdx.x == 0) chunk_decays[slot * g.num_heads + head] = decay_sum;
}

// Grid: (heads, segments, chunks of the longest); block: head_dim * SSM_SCAN_LANES threads. state_size in 16, 32,
// ..., 256 (its registers a thread, a compile-time count).
extern "C" __global__ void __launch_bounds__(1024)
ssm_chunk_scan(bf16* y, long long y_stride, const bf16* xbc, long long xbc_stride, const bf16* dt, long long dt_stride,
               const float* A, const float* D, const float* dt_bias, int num_heads, int head_dim, int n_groups,
               int state_size, float dt_min, float dt_max, float* chunk_states, float* chunk_decays,
               const int* seg_starts, const int* seg_lens, int chunk_size, int pass) {
    wait_for_previous_kernel();
    SsmScanArgs g{pass ? y : nullptr, y_stride, xbc, xbc_stride, dt, dt_stride, A, D, dt_bias, num_heads, head_dim,
                  n_groups, state_size, dt_min, dt_max};
    __shared__ SsmStage stage;
    const int s = blockIdx.y, first = blockIdx.z * chunk_size, len = seg_lens[s];
    if (first >= len) return;
    const long long slot = seg_starts[s] / chunk_size + s + blockIdx.z;
    const int start = seg_starts[s] + first, count = min(chunk_size, len - first);
    switch (state_size / SSM_SCAN_LANES) {
        case 2: ssm_scan_chunk<2>(g, stage, chunk_states, chunk_decays, slot, start, count, pass); break;
        case 4: ssm_scan_chunk<4>(g, stage, chunk_states, chunk_decays, slot, start, count, pass); break;
        case 8: ssm_scan_chunk<8>(g, stage, chunk_states, chunk_decays, slot, start, count, pass); break;
        case 16: ssm_scan_chunk<16>(g, stage, chunk_states, chunk_decays, slot, start, count, pass); break;
        case 32: ssm_scan_chunk<32>(g, stage, chunk_states, chunk_decays, slot, start, count, pass); break;
    }
}

// Between ssm_chunk_scan's passes: each state element of one head of one segment, carried across its chunks from the
// source slot (-1: zeros); chunk_states' entries become the states entering each chunk. Grid: (ceil(head_dim *
// state_size / blockDim.x), heads, segments).
extern "C" __global__ void ssm_chunk_carry(float* ssm_state, float* chunk_states, const float* chunk_decays,
                                           const int* seg_starts, const int* seg_lens, const int* sources,
                                           const int* destinations, int num_heads, int head_dim, int state_size,
                                           int chunk_size) {
    wait_for_previous_kernel();
    const long long per_head = (long long)head_dim * state_size;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int head = blockIdx.y, s = blockIdx.z;
    if (e >= per_head) return;
    const int source = sources[s], destination = destinations[s];
    const long long slot_size = num_heads * per_head, at = head * per_head + e;
    const long long base = seg_starts[s] / chunk_size + s;
    const int chunks = (seg_lens[s] + chunk_size - 1) / chunk_size;
    float h = source >= 0 ? ssm_state[source * slot_size + at] : 0.f;
    for (int c = 0; c < chunks; ++c) {
        float* local = chunk_states + (base + c) * slot_size + at;
        const float end_from_zero = *local;
        *local = h;
        h = expf(chunk_decays[(base + c) * num_heads + head]) * h + end_from_zero;
    }
    if (destination >= 0) ssm_state[destination * slot_size + at] = h;
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
        if (!norm_before_gate) v *= silu(bf16_to_float(gr[i]));
        sum += v * v;
    }
    const float inv = rsqrtf(block_sum(sum) / group_size + eps);
    bf16* orow = out + row * out_stride + base;
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
        const float g = silu(bf16_to_float(gr[i])), w = bf16_to_float(weight[base + i]);
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
