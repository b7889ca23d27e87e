// Row gathers x[rows]: the token embedding lookup (table[token_ids]), sample rows, logits rows; and fairseq's
// position ids of decode rows (the rows of M2M100's position table they gather).
// A row is copied in units of 16, 4 or 2 bytes; the launcher picks the widest unit that divides the row
// length, both row strides and both pointers. Rows are 64-bit offsets: vocab * hidden passes 2^31.
#include "common.cuh"

// grid (num_rows, column chunks), block of threads striding over the units of one row.
// An index outside [0, num_source_rows) yields a zero row instead of reading outside the source.
// No __restrict__: it would let the compiler read source and indices, which the previous kernel writes, through the
// non-coherent path, which programmatic dependent launch does not order (common.cuh).
template <typename Unit>
__device__ __forceinline__ void copy_indexed_row(Unit* out, long long out_stride, const Unit* source,
                                                 long long source_stride, const int* indices, int num_source_rows,
                                                 int units_per_row) {
    const long long row = blockIdx.x;
    const int index = indices[row];
    Unit* dst = out + row * out_stride;
    const bool valid = index >= 0 && index < num_source_rows;
    const Unit* src = source + (long long)(valid ? index : 0) * source_stride;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < units_per_row; i += gridDim.y * blockDim.x) {
        dst[i] = valid ? src[i] : Unit{};
    }
}

// out [N, C], x [T, C] (bf16, fp32 or anything of the unit's width), rows [N] int32; strides and units_per_row in units of the kernel's width.
extern "C" __global__ void gather_rows_16b(uint4* out, long long out_stride, const uint4* x, long long x_stride,
                                           const int* rows, int num_x_rows, int units_per_row) {
    wait_for_previous_kernel();
    copy_indexed_row(out, out_stride, x, x_stride, rows, num_x_rows, units_per_row);
}

extern "C" __global__ void gather_rows_4b(unsigned int* out, long long out_stride, const unsigned int* x,
                                          long long x_stride, const int* rows, int num_x_rows, int units_per_row) {
    wait_for_previous_kernel();
    copy_indexed_row(out, out_stride, x, x_stride, rows, num_x_rows, units_per_row);
}

extern "C" __global__ void gather_rows_2b(unsigned short* out, long long out_stride, const unsigned short* x,
                                          long long x_stride, const int* rows, int num_x_rows, int units_per_row) {
    wait_for_previous_kernel();
    copy_indexed_row(out, out_stride, x, x_stride, rows, num_x_rows, units_per_row);
}

// ids [T] int32: fairseq's position ids (M2M100's sinusoidal table) as transformers counts them: padding_idx where
// the token is padding_idx, else position + 1 + padding_idx. Exact for one-token segments (decode steps) and for
// segments that hold no padding id (an encoder's sources); transformers counts a later token past a padding id
// in its own segment, which a model computes on the host instead.
extern "C" __global__ void fairseq_position_ids(int* ids, const int* token_ids, const int* positions, int num_tokens,
                                                int padding_idx) {
    wait_for_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < num_tokens) ids[i] = token_ids[i] == padding_idx ? padding_idx : positions[i] + 1 + padding_idx;
}
