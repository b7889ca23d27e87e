"""Can NVRTC build CUTLASS's sm90 GEMMs with programmatic dependent launch (GDC) for us? A compile probe, no GPU
needed: one CUTLASS 3.x GEMM (TMA warp-specialized mainloop, wgmma, bf16 in, float accumulate, bf16 out) compiled
to an sm_90a cubin the way cuda_kernels/ are (NVRTC through cuda.core), with CUTLASS_ENABLE_GDC_FOR_SM90; then its
registers and shared memory (ptxas), whether the griddepcontrol pair is in its PTX, and the layout of the kernel's
Params (the 640-odd bytes a launch passes, TMA descriptors included, which a Python launcher must build), read at
compile time. The next step, on a GPU: the Params built in Python and the kernel timed in a chain against
cuBLASLt (bench/NOTES.md, session 11).

The headers come from four wheels, none of them a dependency of the worker (yet):
    pip download --no-deps nvidia-cutlass==4.2.0.0 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 \\
        nvidia-cuda-runtime==13.0.96 -d /tmp/cutlass-wheels
    for f in /tmp/cutlass-wheels/*.whl; do unzip -qo $f -d /tmp/cutlass-headers; done
    python3 -m bench.cutlass_probe --headers /tmp/cutlass-headers [--tile 64,64,64] [--stages 4]
CUTLASS 4.2 needs CUDA 13.0's libcu++ (CCCL 13.3 renamed template parameters that cute redeclares); crt/ holds the
headers <mma.h> includes; NVRTC compiles CUTLASS's unannotated functions only as device functions
(-default-device), and two std:: names CUTLASS uses are not in NVRTC's std (the prelude below).
"""

import argparse
import re
import sys
import time
from pathlib import Path

PRELUDE = """
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include <cuda/std/type_traits>
#include <cuda/std/utility>
namespace std { using cuda::std::is_pointer_v; using cuda::std::void_t; }
"""

# The kernel's entry point (after `Kernel`; doubled braces: the sources are format strings).
ENTRY = """
extern "C" __global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
cutlass_gemm(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {{
    extern __shared__ char smem[];
    Kernel op;
    op(params, smem);
}}
"""

KERNEL = """
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
using namespace cute;
using T = cutlass::bfloat16_t;
using TileShape = Shape<_{m}, _{n}, _{k}>;
using ClusterShape = Shape<_1, _1, _1>;
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    T, cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    T, cutlass::layout::RowMajor, 8, T, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
    {stages}, cutlass::gemm::KernelTmaWarpSpecialized>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
""" + ENTRY

# Compile-time values, each read back from the error NVRTC gives for an incomplete Show<value> (one per probe
# source: the compiler stops reporting after a few).
LAYOUT = {
    "sizeof(Params)": "sizeof(Kernel::Params)",
    "alignof(Params)": "alignof(Kernel::Params)",
    "offset problem_shape": "__builtin_offsetof(Kernel::Params, problem_shape)",
    "offset mainloop": "__builtin_offsetof(Kernel::Params, mainloop)",
    "offset epilogue": "__builtin_offsetof(Kernel::Params, epilogue)",
    "offset hw_info": "__builtin_offsetof(Kernel::Params, hw_info)",
    "sizeof(mainloop params)": "sizeof(Mainloop::Params)",
    "sizeof(epilogue params)": "sizeof(Epilogue::Params)",
    "shared storage bytes": "Kernel::SharedStorageSize",
    "threads": "Kernel::MaxThreadsPerBlock",
}


def include_dirs(headers: Path) -> list[str]:
    cuda = headers / "nvidia" / "cu13" / "include"
    return [str(cuda), str(headers / "cutlass_library" / "source" / "include"), str(cuda / "cccl")]


def program_options(headers: Path, name: str, more_includes: list[str] = (), **extra):
    """NVRTC's options for CUTLASS: sm_90a, C++17, the headers, its unannotated functions as device code."""
    from cuda.core import ProgramOptions

    return ProgramOptions(arch="sm_90a", std="c++17", include_path=include_dirs(headers) + list(more_includes),
                          name=name, define_macro=["NDEBUG"], device_as_default_execution_space=True, **extra)


def compile_cubin(source: str, headers: Path, more_includes: list[str] = ()) -> tuple[bytes, str]:
    from cuda.core import Program

    log = _Log()
    options = program_options(headers, "cutlass_gemm.cu", more_includes, ptxas_options=["-v"])
    return Program(source, "c++", options).compile("cubin", logs=log).code, log.text


def compile_ptx(source: str, headers: Path) -> str:
    """Through nvrtc directly: cuda.core looks for the driver to choose a PTX version, which a GPU-less machine
    lacks."""
    from cuda.bindings import nvrtc

    _, program = nvrtc.nvrtcCreateProgram(source.encode(), b"cutlass_gemm.cu", 0, [], [])
    options = [b"--gpu-architecture=compute_90a", b"-std=c++17", b"-DNDEBUG", b"-default-device"]
    options += [b"-I" + d.encode() for d in include_dirs(headers)]
    (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC: {status}")
    _, size = nvrtc.nvrtcGetPTXSize(program)
    buffer = b" " * size
    nvrtc.nvrtcGetPTX(program, buffer)
    return buffer.decode(errors="replace")


def compile_time_value(kernel: str, expression: str, headers: Path) -> int | None:
    """The value of a constant expression over the kernel's types, from NVRTC's error on Show<expression>."""
    from cuda.core import Program

    source = (kernel + "\ntemplate <long long N> struct Show;\n"
              f"__device__ void probe() {{ Show<(long long)({expression})> s; }}\n")
    try:
        Program(source, "c++", program_options(headers, "probe.cu")).compile("cubin")
    except Exception as error:     # the expected outcome: Show<N> is incomplete
        found = re.search(r'incomplete type "Show<(-?\d+)', str(error))
        return int(found.group(1)) if found else None
    return None


class _Log:
    def __init__(self):
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text.replace("\0", "")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headers", type=Path, required=True, help="the four wheels unzipped into one directory")
    parser.add_argument("--tile", default="64,64,64", help="the CTA tile M,N,K")
    parser.add_argument("--stages", type=int, default=4,
                        help="mainloop stages (0: as many as shared memory holds, CUTLASS's default; few leave room "
                             "for the kernel before to run beside it, which PDL needs)")
    args = parser.parse_args(argv)
    m, n, k = (int(x) for x in args.tile.split(","))
    stages = (f"cutlass::gemm::collective::StageCount<{args.stages}>" if args.stages else
              "cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename "
              "Epilogue::SharedStorage))>")
    kernel = PRELUDE + KERNEL.format(m=m, n=n, k=k, stages=stages)
    started = time.perf_counter()
    cubin, log = compile_cubin(kernel, args.headers)
    seconds = time.perf_counter() - started
    usage = re.search(r"Used (\d+) registers", log)
    ptx = compile_ptx(kernel, args.headers)
    result = {"tile": (m, n, k), "stages": args.stages or "auto", "compile_s": round(seconds, 1),
              "cubin_bytes": len(cubin),
              "registers": int(usage.group(1)) if usage else None,
              "griddepcontrol.wait": "griddepcontrol.wait" in ptx,
              "griddepcontrol.launch_dependents": "griddepcontrol.launch_dependents" in ptx,
              "wgmma": ptx.count("wgmma.mma_async"), "tma loads": ptx.count("cp.async.bulk.tensor")}
    result.update({name: compile_time_value(kernel, expression, args.headers) for name, expression in LAYOUT.items()})
    for name, value in result.items():
        print(f"{name:>34}: {value}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
