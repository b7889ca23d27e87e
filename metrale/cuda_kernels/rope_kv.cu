// Rotary embedding of q and k (rotate-half layout) fused with the write of k and v into the paged KV cache; the
// write alone (an encoder-decoder's cross-attention K/V); and copies of block prefixes (beam search).
//
// qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] bf16, row stride in elements: per token, q heads, then k
//   heads, then v heads, each head_dim contiguous. After the call q and k in qkv are rotated, v is unchanged.
// cos, sin [P, head_dim / 2] fp32 (angle = position * inv_freq[i]); positions [T] int32 in [0, P).
// Rotate-half: element i pairs with i + head_dim / 2 (i < head_dim / 2), in fp32, rounded to bf16 once:
//   out[i] = x[i] * cos[i] - x[i + half] * sin[i];  out[i + half] = x[i + half] * cos[i] + x[i] * sin[i].
// kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16, contiguous, one layer; plane 0 holds k,
//   plane 1 holds v. Token t with slot = slot_mapping[t] writes kv_cache[p, slot / block_size,
//   slot % block_size, :, :], i.e. the flat [2, num_slots, num_kv_heads, head_dim] index [p, slot]. A negative
//   slot (a padding token) writes nothing.
// Each thread owns one group: 4 pairs (elements 4g..4g+3 and half+4g..half+4g+3) of one head of one token,
// loaded as two 8-byte vectors; cos/sin of the group are one float4 each. head_dim % 8 == 0.
#include "common.cuh"

// Four bf16 (two pairs) over scale -> four e4m3, the lowest index in the low byte.
__device__ __forceinline__ unsigned int e4m3x4(uint2 v, float scale) {
    const float2 lo = bf16x2_to_float2(v.x), hi = bf16x2_to_float2(v.y);
    return float2_to_e4m3x2(lo.x / scale, lo.y / scale) | (float2_to_e4m3x2(hi.x / scale, hi.y / scale) << 16);
}

// grid (T, ceil(items / blockDim.x)), items = (num_heads + 2 * num_kv_heads) * head_dim / 8 per token.
// FP8: kv_cache holds e4m3 bytes, each K or V value over its head's scale (kv_scales [2, num_kv_heads] float32,
// K's then V's), rounded to nearest even and saturated at +-448 (the rotated k as bf16 first, as the bf16 cache
// would hold it); otherwise bf16, and kv_scales is not read.
template <bool FP8>
__device__ __forceinline__ void rope_and_write(bf16* qkv, long long qkv_stride, const float* cos, const float* sin,
                                               const int* positions, const int* slot_mapping, void* kv_cache,
                                               const float* kv_scales, long long num_slots, int num_heads,
                                               int num_kv_heads, int head_dim) {
    const long long token = blockIdx.x;
    const int groups_per_head = head_dim >> 3;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    if (item >= (num_heads + 2 * num_kv_heads) * groups_per_head) return;
    const int head = item / groups_per_head;
    const int group = item - head * groups_per_head;
    const int half = head_dim >> 1;
    bf16* head_start = qkv + token * qkv_stride + (long long)head * head_dim;
    uint2* first = reinterpret_cast<uint2*>(head_start + 4 * group);
    uint2* second = reinterpret_cast<uint2*>(head_start + half + 4 * group);
    uint2 a = *first, b = *second;
    int plane, kv_head;
    if (head < num_heads + num_kv_heads) {
        const long long angle = (long long)positions[token] * half + 4 * group;
        const float4 c = *reinterpret_cast<const float4*>(cos + angle);
        const float4 s = *reinterpret_cast<const float4*>(sin + angle);
        rotate_pair2(a.x, b.x, c.x, c.y, s.x, s.y);
        rotate_pair2(a.y, b.y, c.z, c.w, s.z, s.w);
        *first = a;
        *second = b;
        if (head < num_heads) return;
        plane = 0;
        kv_head = head - num_heads;
    } else {
        plane = 1;
        kv_head = head - num_heads - num_kv_heads;
    }
    const int slot = slot_mapping[token];
    if (slot < 0) return;
    const long long offset = (plane * num_slots + slot) * num_kv_heads * head_dim + (long long)kv_head * head_dim;
    if constexpr (FP8) {
        const float scale = kv_scales[plane * num_kv_heads + kv_head];
        unsigned char* dst = static_cast<unsigned char*>(kv_cache) + offset;
        *reinterpret_cast<unsigned int*>(dst + 4 * group) = e4m3x4(a, scale);
        *reinterpret_cast<unsigned int*>(dst + half + 4 * group) = e4m3x4(b, scale);
    } else {
        bf16* dst = static_cast<bf16*>(kv_cache) + offset;
        *reinterpret_cast<uint2*>(dst + 4 * group) = a;
        *reinterpret_cast<uint2*>(dst + half + 4 * group) = b;
    }
}

#define ROPE_AND_WRITE_KV(NAME, FP8)                                                                            \
    extern "C" __global__ void NAME(bf16* qkv, long long qkv_stride, const float* cos, const float* sin,      \
                                    const int* positions, const int* slot_mapping, void* kv_cache,             \
                                    const float* kv_scales, long long num_slots, int num_heads,                \
                                    int num_kv_heads, int head_dim) {                                          \
        wait_for_previous_kernel();                                                                             \
        rope_and_write<FP8>(qkv, qkv_stride, cos, sin, positions, slot_mapping, kv_cache, kv_scales, num_slots, \
                            num_heads, num_kv_heads, head_dim);                                                 \
    }
ROPE_AND_WRITE_KV(rope_and_write_kv, false)
ROPE_AND_WRITE_KV(rope_and_write_kv_fp8, true)

// k, v [T, num_kv_heads * head_dim] bf16 (row strides in elements, multiples of 8) into kv_cache at slot_mapping,
// as rope_and_write_kv writes them, without rotation. grid (T, ceil(units / blockDim.x)), units = 2 * width / 8:
// one 16-byte unit of k or of v per thread.
extern "C" __global__ void write_kv(const bf16* k, long long k_stride, const bf16* v, long long v_stride,
                                    const int* slot_mapping, bf16* kv_cache, long long num_slots, int width) {
    wait_for_previous_kernel();
    const long long token = blockIdx.x;
    const int units = width >> 3;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    if (item >= 2 * units) return;
    const int slot = slot_mapping[token];
    if (slot < 0) return;
    const int plane = item >= units, unit = item - plane * units;
    const bf16* row = plane ? v + token * v_stride : k + token * k_stride;
    bf16* dst = kv_cache + (plane * num_slots + slot) * (long long)width;
    reinterpret_cast<uint4*>(dst)[unit] = reinterpret_cast<const uint4*>(row)[unit];
}

// For each copy (src block, dst block, n) of copies [num_copies, 3] int32 and each layer: the first n slots of
// block src, k and v planes, into block dst. Layer l's cache starts layer_stride bytes after layer l - 1's;
// each is [2, num_blocks, block_size, slot_bytes] (bf16 or e4m3 values: bytes here). grid (num_copies,
// num_layers, 2): one (copy, layer, plane) per CTA, 16-byte units; slot_bytes % 16 == 0.
extern "C" __global__ void copy_kv_prefixes(unsigned char* kv_cache, long long layer_stride, long long plane_bytes,
                                            int block_size, int slot_bytes, const int* copies) {
    wait_for_previous_kernel();
    const int* copy = copies + 3 * blockIdx.x;
    const int src = copy[0], dst = copy[1], n = copy[2];
    const long long base = blockIdx.y * layer_stride + blockIdx.z * plane_bytes;
    const long long block_bytes = (long long)block_size * slot_bytes;
    const uint4* from = reinterpret_cast<const uint4*>(kv_cache + base + src * block_bytes);
    uint4* to = reinterpret_cast<uint4*>(kv_cache + base + dst * block_bytes);
    const int units = (n * slot_bytes) >> 4;
    for (int i = threadIdx.x; i < units; i += blockDim.x) to[i] = from[i];
}
