// What the decode attention kernels share (decode_attention.cu: the grouped-query kernel and the merge of splits;
// decode_attention_mha.cu: the multi-head kernels): a split's keys, the launch's arguments, and the entry points'
// parameter list.
#pragma once
#include "attention_tiles.cuh"

namespace {

// The keys [lo, hi) split `split` of a decode sequence attends within its window; whole: one split holds them all
// (the sequence's row is written directly, paged_decode_reduce skips it).
struct DecodeKeys {
    int lo, hi;
    bool whole;
};

__device__ __forceinline__ DecodeKeys decode_keys(int context, int sliding_window, int split, int partition_size) {
    const int window_start = sliding_window > 0 ? max(0, context - sliding_window) : 0;
    return {max(window_start, split * partition_size), min(context, (split + 1) * partition_size),
            window_start / partition_size == (context - 1) / partition_size};
}

// A decode launch's arguments, as kernels/attention.py passes them (DECODE_ENTRY builds this from the entry's
// parameters). heads: the grouped kernel's group size, the multi-head kernel's num_heads.
struct DecodeArgs {
    bf16* out;
    long long out_stride;
    const bf16* q;
    long long q_stride;
    const bf16* kv_cache;
    long long plane_elems;       // one of the cache's K and V planes
    const int* seq_rows;
    const int* context_lens;
    const int* block_tables;
    int max_blocks;
    float* partial_out;
    float* partial_lse;
    int heads, block_shift;
    float scale_log2;
    int sliding_window, partition_size;
};

}  // namespace

// The extern "C" entry points take DecodeArgs' fields as their parameters (kernels/attention.py passes them in
// that order): DECODE_ENTRY's NAME##_hd##HEAD_DIM runs NAME<HEAD_DIM> in BLOCK threads; the multi-head
// variants' entries (decode_attention_mha.cu) take their own fields after them.
#define DECODE_PARAMS                                                                                            \
    bf16 *out, long long out_stride, const bf16 *q, long long q_stride, const bf16 *kv_cache,                   \
        long long plane_elems, const int *seq_rows, const int *context_lens, const int *block_tables,           \
        int max_blocks, float *partial_out, float *partial_lse, int heads, int block_shift, float scale_log2,   \
        int sliding_window, int partition_size
#define DECODE_ARGS                                                                                              \
    {out, out_stride, q, q_stride, kv_cache, plane_elems, seq_rows, context_lens, block_tables, max_blocks,     \
     partial_out, partial_lse, heads, block_shift, scale_log2, sliding_window, partition_size}

#define DECODE_ENTRY(NAME, BLOCK, HEAD_DIM)                                                                      \
    extern "C" __global__ void __launch_bounds__(BLOCK) NAME##_hd##HEAD_DIM(DECODE_PARAMS) {                     \
        wait_for_previous_kernel();                                                                              \
        NAME<HEAD_DIM>(DECODE_ARGS);                                                                             \
    }

