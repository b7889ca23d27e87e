// Tensor-core building blocks shared by the attention tiles and the fused linears: cp.async copies into shared
// memory, ldmatrix, mma.sync m16n8k16 (bf16 in, fp32 accumulate), and the streaming load of a weight.
// Fragment layouts: attention_tiles.cuh's header.
#pragma once
#include "common.cuh"

namespace {

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, asynchronous; an invalid chunk is zero-filled and reads nothing.
__device__ __forceinline__ void copy_async_16(void* shared, const void* global, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 ::"r"(shared_address(shared)), "l"(global), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(pending)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const bf16* shared) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(shared)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const bf16* shared) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(shared)));
}

// c [16x8] += a [16x16] * b [16x8]
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes of a weight, or zeros where !valid (no access): read once, so not kept in L1 (L2 fetches the whole
// 256-byte line). The predicate is inside the asm so that a batch of loads is one basic block (a branch per load
// makes ptxas peel and reorder the loop). Only for data no kernel writes: ld.global.nc is not ordered by
// griddepcontrol.wait (common.cuh), so it may also be issued before that wait.
__device__ __forceinline__ uint4 load_weight(const uint4* pointer, bool valid) {
    uint4 v;
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
                 " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
                 " @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(pointer), "r"((int)valid));
    return v;
}

}  // namespace
