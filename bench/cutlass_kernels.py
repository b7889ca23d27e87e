"""The CUTLASS GEMMs bench/gpu_cutlass_gemm.py times, as NVRTC sources and their build: CUTLASS's TMA
warp-specialized GEMM ("plain", bench/cutlass_probe.py's), and the GEMM of CUTLASS's example 63 ("prefetch": the
warp loading the weight does not wait for the kernel before; an L2 prefetch warp; launch_dependent_grids after a
share of the K tiles), composed for bf16, with no bias, a bias, or a bias then ReLU in its epilogue. Each module
also holds cutlass_gemm_params, which builds the GEMM's Params on the device (CUTLASS's own argument conversion,
the host-encoded TMA descriptors copied in).

The headers come from the wheels bench/cutlass_probe.py names; example 63 is included from the nvidia-cutlass wheel,
not copied. Built here, run there:
    python3 -m bench.gpu_cutlass_gemm build --headers /tmp/cutlass-headers --out .cutlass
"""

from pathlib import Path

from bench.cutlass_probe import ENTRY, KERNEL, PRELUDE

# (variant, tile): "plain" is CUTLASS's TMA warp-specialized GEMM with A = x (tokens as M); "prefetch" is the kernel
# of CUTLASS's example 63 (split DMA: the warp loading A, here the weight, as M, does not wait for the kernel before;
# an L2 prefetch warp; launch_dependent_grids after overlap_ratio of the K tiles), bf16, tokens as N.
TILES = (("plain", (64, 8, 64)), ("plain", (64, 16, 64)), ("plain", (64, 8, 128)),
         ("prefetch", (64, 8, 128)), ("prefetch", (64, 16, 128)), ("prefetch", (64, 32, 64)),
         ("prefetch_bias", (64, 16, 128)), ("prefetch_relu", (64, 16, 128)))
STAGES = 4
# The prefetch variant's runtime settings (the example's Arguments), each pair a column: launch_dependent_grids after
# this share of the K tiles is loaded (< 0: never early); prefetch this share of the weight's K tiles into L2 (<= 0:
# no prefetch warp).
RATIOS = ((0.5, 0.5), (0.0, -1.0), (0.9, 0.9))
# Params for cutlass_gemm on the device: CUTLASS's own argument conversion, the host-encoded TMA descriptors copied
# in. info: grid x, y, z, sizeof(Params), shared storage bytes, threads. {extra}: the variant's further parameters and
# arguments; {c_stride}: C's and D's (row-major for the plain variant, column-major for the prefetch one).
PARAMS_KERNEL = """
extern "C" __global__ void cutlass_gemm_params(typename Kernel::Params* out, int* info,
        const __grid_constant__ cute::TmaDescriptor desc_a, const __grid_constant__ cute::TmaDescriptor desc_b,
        int m, int n, int k, const T* a, long long lda, const T* b, long long ldb, const T* c, long long ldc, T* d,
        long long ldd, float alpha, float beta{extra_params}) {{
    typename Kernel::Arguments args{{}};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = make_shape(m, n, k, 1);
    args.mainloop.ptr_A = a;
    args.mainloop.dA = make_stride((int64_t)lda, Int<1>{{}}, (int64_t)m * lda);
    args.mainloop.ptr_B = b;
    args.mainloop.dB = make_stride((int64_t)ldb, Int<1>{{}}, (int64_t)n * ldb);{extra_args}
    args.epilogue.thread.alpha = alpha;
    args.epilogue.thread.beta = beta;
    {c_args}
    args.epilogue.dC = {c_stride};
    args.epilogue.ptr_D = d;
    args.epilogue.dD = {d_stride};
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
    params.mainloop.tma_load_a.tma_desc_ = desc_a;
    params.mainloop.tma_load_b.tma_desc_ = desc_b;
    *out = params;
    const dim3 grid = Kernel::get_grid_shape(params);
    info[0] = grid.x; info[1] = grid.y; info[2] = grid.z;
    info[3] = sizeof(params);
    info[4] = Kernel::SharedStorageSize;
    info[5] = Kernel::MaxThreadsPerBlock;
}}
"""


PREFETCH_KERNEL = """
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include "collective/dispatch_policy_extra.hpp"
#include "collective/builder.hpp"
#include "kernel/sm90_gemm_tma_warpspecialized_with_prefetch.hpp"
using namespace cute;
using T = cutlass::bfloat16_t;
using TileShape = Shape<_{m}, _{n}, _{k}>;
using ClusterShape = Shape<_1, _1, _1>;
// The example's builder takes FP8 only; its mainloop does not care: composed here for bf16, both operands K-major.
using Policy = cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedWithPrefetch<{stages}, ClusterShape,
    cutlass::gemm::KernelTmaWarpSpecializedFP8FastAccumWithPrefetchAndSplitDMA>;
using TiledMma = decltype(make_tiled_mma(GMMA::ss_op_selector<T, T, float, TileShape, GMMA::Major::K, GMMA::Major::K>(),
                                         Layout<Shape<_1, _1, _1>>{{}}));
using SmemAtomA = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, _{m}, _{k}>());
using SmemAtomB = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, _{n}, _{k}>());
using Mainloop = cutlass::gemm::collective::CollectiveMma<Policy, TileShape,
    T, cutlass::gemm::TagToStrideA_t<cutlass::layout::RowMajor>,
    T, cutlass::gemm::TagToStrideB_t<cutlass::layout::ColumnMajor>, TiledMma,
    SM90_TMA_LOAD, SmemAtomA, void, cute::identity, SM90_TMA_LOAD, SmemAtomB, void, cute::identity>;
// D [M = features, N = tokens] column-major: the row-major out [tokens, features].
{epilogue}
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
""" + ENTRY

# The prefetch variants' epilogues: CUTLASS's choice (alpha * acc + beta * C), or act(acc + bias[feature]) as
# nn.Linear's bias and M2M100's fc1 ReLU take it (the sum in float, rounded to bf16 once; no C read).
EPILOGUES = {
    "prefetch": """using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    T, cutlass::layout::ColumnMajor, 8, T, cutlass::layout::ColumnMajor, 8,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;""",
    "prefetch_bias": "Identity",
    "prefetch_relu": "ReLu",
}
BIASED = ("prefetch_bias", "prefetch_relu")
BIAS_EPILOGUE = """#include <cutlass/epilogue/collective/epilogue_tensor_broadcast.hpp>
#include <cutlass/epilogue/thread/linear_combination_tensor_broadcast.hpp>
#include <cutlass/epilogue/thread/activation.h>
using StrideCD = cutlass::detail::TagToStrideC_t<cutlass::layout::ColumnMajor>;
using ThreadOp = cutlass::epilogue::thread::LinearCombinationTensorBroadcast<T, float, float, T,
    cutlass::epilogue::thread::{act}, cutlass::epilogue::thread::detail::NoOp>;
using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
    cutlass::epilogue::collective::EpilogueTensorBroadcast<StrideCD, StrideCD, ThreadOp,
                                                           cutlass::gemm::EpilogueDefault>>;"""



def source(variant: str, tile) -> str:
    m, n, k = tile
    if variant in EPILOGUES:
        biased = variant != "prefetch"
        epilogue = BIAS_EPILOGUE.format(act=EPILOGUES[variant]) if biased else EPILOGUES[variant]
        return PRELUDE + PREFETCH_KERNEL.format(m=m, n=n, k=k, stages=STAGES, epilogue=epilogue) + \
            PARAMS_KERNEL.format(
                extra_params=", float overlap_ratio, float prefetch_ratio" + (", const T* bias" if biased else ""),
                extra_args="\n    args.mainloop.overlap_ratio = overlap_ratio;"
                           "\n    args.mainloop.prefetch_ratio = prefetch_ratio;",
                c_args=("args.epilogue.ptr_C0 = const_cast<T*>(c); args.epilogue.ptr_Bias = const_cast<T*>(bias);"
                        if biased else "args.epilogue.ptr_C = c;"),
                c_stride="make_stride(Int<1>{}, (int64_t)ldc, (int64_t)n * ldc)",
                d_stride="make_stride(Int<1>{}, (int64_t)ldd, (int64_t)n * ldd)")
    return PRELUDE + KERNEL.format(m=m, n=n, k=k, stages=f"cutlass::gemm::collective::StageCount<{STAGES}>") \
        + PARAMS_KERNEL.format(extra_params="", extra_args="", c_args="args.epilogue.ptr_C = c;",
                               c_stride="make_stride((int64_t)ldc, Int<1>{}, (int64_t)m * ldc)",
                               d_stride="make_stride((int64_t)ldd, Int<1>{}, (int64_t)m * ldd)")


def cubin_name(variant: str, tile) -> str:
    return f"cutlass_gemm_{variant}_{'x'.join(map(str, tile))}.cubin"


def example_dir(headers: Path) -> Path:
    """CUTLASS's example 63 (GEMM with weight prefetch), shipped in the nvidia-cutlass wheel: included, not copied."""
    return headers / "cutlass_library" / "source" / "examples" / "63_hopper_gemm_with_weight_prefetch"


def build(headers: Path, out: Path) -> None:
    from bench.cutlass_probe import compile_cubin

    out.mkdir(parents=True, exist_ok=True)
    for variant, tile in TILES:
        extra = [str(example_dir(headers))] if variant in EPILOGUES else []
        cubin, log = compile_cubin(source(variant, tile), headers, extra)
        (out / cubin_name(variant, tile)).write_bytes(cubin)
        print(variant, tile, len(cubin), [line for line in log.splitlines() if "registers" in line], flush=True)
