// Hopper's warpgroup primitives (sm_90a only: wgmma, mbarriers, the async proxy), used by kernels that keep a
// tile pipeline of producer and consumer warpgroups: shared-memory matrix descriptors for the 128-byte swizzle,
// wgmma.mma_async with operands from shared memory or registers, mbarrier waits and arrivals.
//
// 128-byte swizzle (PTX ISA, "Shared Memory Matrix Layout"): a tile of rows of 64 bf16 (128 bytes) whose 16-byte
// chunk c of row r sits at r * 128 + ((c ^ (r & 7)) * 16), from a 1024-byte aligned base. A wider row is split
// into such 64-column tiles, each its own block of rows. Descriptors of such tiles:
//   K-major (the reduction dimension along the 128-byte rows): 8-row groups 1024 bytes apart (stride offset), the
//     k-th 16-element step starting 32 * k bytes into the rows;
//   MN-major (rows along the reduction dimension, each holding 64 of the M or N dimension): 8-row groups 1024
//     bytes apart (stride offset), the next 64 of M or N in the next 64-column tile (leading offset).
#pragma once
#include "mma.cuh"

namespace {

constexpr int SWIZZLE_ROW_BYTES = 128;   // one row of a 128-byte swizzled tile: 64 bf16

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte swizzled tile.
__device__ __forceinline__ unsigned swizzled_offset(int row, int chunk) {
    return row * SWIZZLE_ROW_BYTES + ((chunk ^ (row & 7)) << 4);
}

// A wgmma shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets.
__device__ __forceinline__ unsigned long long matrix_descriptor(unsigned start, unsigned leading, unsigned stride) {
    return (unsigned long long)((start & 0x3ffff) >> 4) | ((unsigned long long)((leading & 0x3ffff) >> 4) << 16) |
           ((unsigned long long)((stride & 0x3ffff) >> 4) << 32) | (1ull << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void warpgroup_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void warpgroup_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int pending>
__device__ __forceinline__ void warpgroup_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}

// Pins accumulator registers in place: their reads stay after a warpgroup_wait, their writes before the next
// wgmma (the asm statements of the wgmma and the wait name no registers the compiler could order by).
template <int N>
__device__ __forceinline__ void pin_registers(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Makes this thread's generic-proxy writes to shared memory (st.shared, completed cp.async) visible to the async
// proxy (wgmma operands) of the threads that synchronize with it afterwards.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void barrier_init(unsigned barrier, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}

// Arrives on the barrier once this thread's cp.async copies issued so far have landed (without waiting for them
// here); the barrier's count includes this arrival.
__device__ __forceinline__ void barrier_arrive_on_copies(unsigned barrier) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}

// Arrives on the barrier and adds `bytes` to the transaction bytes its phase waits for (tensor_copy_4d's).
__device__ __forceinline__ void barrier_arrive_expect(unsigned barrier, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

// The box of a 4-D tensor map (its address in global memory) at coordinates x, y, z, w (innermost first) into
// shared memory at `destination`, laid out as the map's swizzle says; its bytes count on the barrier as they land.
__device__ __forceinline__ void tensor_copy_4d(unsigned destination, const void* map, int x, int y, int z, int w,
                                               unsigned barrier) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4, %5}], [%6];\n" ::"r"(destination), "l"(map), "r"(x), "r"(y), "r"(z), "r"(w), "r"(barrier)
                 : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(unsigned barrier, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
    } while (!done);
}

// Named barrier `id` (1..15; 0 is __syncthreads') over `threads` threads: wait for them all, or arrive only.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Hands registers between warpgroups (every warp of the warpgroup executes it): a loading warpgroup gives some
// back, computing ones take them; the totals must fit the SM's register file.
template <int registers>
__device__ __forceinline__ void registers_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(registers));
}

template <int registers>
__device__ __forceinline__ void registers_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(registers));
}

// wgmma.mma_async m64nNk16, bf16 in, fp32 accumulate, over a warpgroup; d is this thread's share of the 64 x N
// accumulator (the mma.m16n8k16 C layout of its warp's 16 rows, repeated over the N / 8 column blocks:
// d[4j .. 4j + 3] = C[g][8j + 2t, +1], C[g + 8][8j + 2t, +1]).
//   shared_a:    d (+)= A [64 x 16] (a_desc, K-major) * B [16 x N] (b_desc, K-major); accumulate 0 overwrites d
//                (N = 128: S = Q K^T of a 128-key tile).
//   registers_a: d += A [64 x 16] * B [16 x N] (b_desc, MN-major); a is this thread's mma.m16n8k16 A fragment of
//                its warp's 16 rows.
template <int N>
struct Wgmma;

template <>
struct Wgmma<64> {
    static __device__ __forceinline__ void registers_a(float (&d)[32], const unsigned (&a)[4],
                                                       unsigned long long b_desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                     "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                       "+f"(d[30]), "+f"(d[31])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
    }
};

template <>
struct Wgmma<128> {
    static __device__ __forceinline__ void shared_a(float (&d)[64], unsigned long long a_desc,
                                                    unsigned long long b_desc, int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                     "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                       "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                       "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                       "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                       "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                       "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate));
    }
    static __device__ __forceinline__ void registers_a(float (&d)[64], const unsigned (&a)[4],
                                                       unsigned long long b_desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                     "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                       "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                       "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                       "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                       "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                       "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace
