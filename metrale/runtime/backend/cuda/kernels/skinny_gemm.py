"""Launcher for cuda_kernels/gemv.cu: the skinny GEMM of decode linears, out = x @ weight.T (+ bias), M <= 16, for a
bf16 weight and for an Fp8Matrix (e4m3 with a scale a row, or a row per 128 columns, widened to bf16 in
registers); and a dense gated MLP's gate/up with its activation in the same launch (skinny_gated)."""

import numpy as np

from metrale.runtime.backend.cuda.fp8_matrix import BLOCK, K_MULTIPLE, Fp8Matrix
from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument

MODULE = "gemv"
MAX_M = 16
THREADS = 256            # as in gemv.cu: 8 warps
TILE_ROWS = 16           # as in gemv.cu: weight rows per CTA
OUT_DTYPES = ("bfloat16", "float32")
# (M <= 8, out dtype) -> kernel: M <= 8 is one 8-token mma tile, M <= 16 two.
KERNELS = {(True, "bfloat16"): "skinny_gemm_m8_bf16", (True, "float32"): "skinny_gemm_m8_f32",
           (False, "bfloat16"): "skinny_gemm_m16_bf16", (False, "float32"): "skinny_gemm_m16_f32"}
# (M <= 8, weight in blocks) -> kernel, bf16 out.
FP8_KERNELS = {(True, False): "skinny_gemm_m8_fp8", (False, False): "skinny_gemm_m16_fp8",
               (True, True): "skinny_gemm_m8_fp8_blocks", (False, True): "skinny_gemm_m16_fp8_blocks"}
# (M <= 8, weight form) -> the gated kernel: gate/up and silu(gate) * up in one launch, bf16 out.
GATED_KERNELS = {(fits8, form): f"skinny_gated_m{8 if fits8 else 16}_{form}" for fits8 in (True, False)
                 for form in ("bf16", "fp8", "fp8_blocks")}
NULL = np.uint64(0)


def unsupported_reason(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor | Fp8Matrix,
                       bias: DeviceTensor | None) -> str | None:
    """Why skinny_linear cannot run this linear, or None. Plain comparisons; a message is formatted only on failure."""
    problem = inputs_reason(x, weight)
    if problem is not None:
        return problem
    m, n = x.shape[0], weight.shape[0]
    if out.shape != (m, n) or out.dtype not in OUT_DTYPES:
        return f"out must be [{m}, {n}] in one of {OUT_DTYPES}, not {out.shape} {out.dtype}"
    if isinstance(weight, Fp8Matrix) and out.dtype != "bfloat16":
        return f"an FP8 weight's out must be bfloat16, not {out.dtype}"
    problem = _out_reason(out)
    if problem is None and bias is not None and (bias.shape != (n,) or bias.dtype != out.dtype
                                                 or bias.ptr % bias.itemsize):
        problem = (f"bias must be an aligned [{n}] {out.dtype} (out's dtype), not {bias.shape} {bias.dtype} "
                   f"at {bias.ptr:#x}")
    return problem


def inputs_reason(x: DeviceTensor, weight: DeviceTensor | Fp8Matrix) -> str | None:
    """Why the skinny kernels cannot read this x and weight, or None (M <= MAX_M, K % 8 == 0, dtypes, alignment)."""
    if len(x.shape) != 2 or x.dtype != "bfloat16":
        return f"x must be [M, K] bfloat16, not {x.shape} {x.dtype}"
    if isinstance(weight, Fp8Matrix):
        problem = _fp8_problem(weight)
        if problem is not None:
            return problem
    elif len(weight.shape) != 2 or weight.dtype != "bfloat16" or not weight.is_contiguous:
        return f"weight must be a contiguous [N, K] bfloat16, not {weight.shape} {weight.dtype} stride {weight.stride}"
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        return f"M = {m} is over {MAX_M}"
    if weight.shape[1] != k or n == 0 or k == 0:
        return f"x {x.shape} and weight {weight.shape} must agree on a non-zero K, with N > 0"
    if k % 8:
        return f"K = {k} must be a multiple of 8"
    if x.stride < k:
        return f"a row stride is shorter than its row (x {x.stride} < {k})"
    weight_ptr = weight.data.ptr if isinstance(weight, Fp8Matrix) else weight.ptr
    if (x.ptr | weight_ptr | 2 * x.stride) % 16:
        return (f"x and weight must be 16-byte aligned (pointer and row stride): x {x.ptr:#x} stride {x.stride}, "
                f"weight {weight_ptr:#x}")
    return None


def _out_reason(out: DeviceTensor) -> str | None:
    """Why the kernels cannot write this out (its shape and dtype checked already), or None."""
    if out.stride < out.shape[1]:
        return f"a row stride is shorter than its row (out {out.stride} < {out.shape[1]})"
    if out.ptr % out.itemsize:
        return f"out {out.ptr:#x} is not {out.itemsize}-byte aligned"
    return None


def _fp8_problem(weight: Fp8Matrix) -> str | None:
    """Why the FP8 kernels cannot take this weight, or None."""
    data, scales = weight.data, weight.scales
    if len(data.shape) != 2 or data.dtype != "float8_e4m3" or not data.is_contiguous or data.shape[1] % K_MULTIPLE:
        return (f"an FP8 weight must be a contiguous [N, K] float8_e4m3 with K % {K_MULTIPLE} == 0, not {data.shape} "
                f"{data.dtype}")
    n, k = data.shape
    want = (k // BLOCK, n) if weight.blocks else (n,)
    if scales.shape != want or scales.dtype != "float32" or (weight.blocks and k % BLOCK):
        return f"an FP8 weight's scales must be {list(want)} float32, not {scales.shape} {scales.dtype}"
    return None


def gated_inputs_reason(x: DeviceTensor, weight: DeviceTensor | Fp8Matrix) -> str | None:
    """Why skinny_gated cannot read this x and gate/up weight [2 I, K] (I % 8 == 0), or None."""
    if weight.shape[0] % 16:
        return f"a gated weight's rows ({weight.shape[0]}) must be two halves of a multiple of 8"
    return inputs_reason(x, weight)


def gated_unsupported_reason(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor | Fp8Matrix) -> str | None:
    """Why skinny_gated cannot run this gate/up, or None: gated_inputs_reason, and out [M, I] bf16."""
    problem = gated_inputs_reason(x, weight)
    if problem is not None:
        return problem
    m, half = x.shape[0], weight.shape[0] // 2
    if out.shape != (m, half) or out.dtype != "bfloat16":
        return f"out must be [{m}, {half}] bfloat16, not {out.shape} {out.dtype}"
    return _out_reason(out)


def supports(x: DeviceTensor, weight: DeviceTensor | Fp8Matrix, out: DeviceTensor,
             bias: DeviceTensor | None = None) -> bool:
    """Whether skinny_linear takes this linear (M <= MAX_M, K % 8 == 0, alignment, dtypes); never raises."""
    return unsupported_reason(out, x, weight, bias) is None


def skinny_linear(lib, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor | Fp8Matrix,
                  bias: DeviceTensor | None = None, relu: bool = False) -> None:
    """out [M, N] = x [M, K] @ weight [N, K].T (+ bias [N]) in one launch, for M <= 16 (decode rows).
    x: bf16, may be a column slice (row stride a multiple of 8 elements); weight: bf16, contiguous; out: bf16 or
    float32 (logits), may be a column slice; bias: out's dtype. x and weight 16-byte aligned; K % 8 == 0.
    fp32 accumulation, rounded once to out's dtype (bias added, then max(., 0) if relu, before rounding). M == 0
    launches nothing. An Fp8Matrix weight (K % 16 == 0, out bf16) gives the result of its values dequantized and
    rounded to bf16, bit for bit."""
    problem = unsupported_reason(out, x, weight, bias)
    if problem is not None:
        raise InvalidArgument(f"skinny_linear: {problem}")
    m, k = x.shape
    if m == 0:
        return
    n = out.shape[1]
    if isinstance(weight, Fp8Matrix):
        launch_kernel(stream, lib.get(FP8_KERNELS[m <= 8, weight.blocks], MODULE), ceil_div(n, TILE_ROWS), THREADS, out,
                      np.int64(out.stride), x, np.int64(x.stride // 8), weight.data, weight.scales,
                      bias if bias is not None else NULL, m, n, k // 8, int(relu))
        return
    kernel = lib.get(KERNELS[m <= 8, out.dtype], MODULE)
    launch_kernel(stream, kernel, ceil_div(n, TILE_ROWS), THREADS, out, np.int64(out.stride), x,
                  np.int64(x.stride // 8), weight, bias if bias is not None else NULL, m, n, k // 8, int(relu))


def skinny_gated(lib, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor | Fp8Matrix) -> None:
    """out [M, I] = silu(x @ gate.T) * (x @ up.T) for a dense gated MLP's weight [gate; up] [2 I, K] (I % 8 == 0),
    M <= 16, in one launch: bit for bit skinny_linear's [M, 2 I] followed by activation.silu_mul. x and weight as
    skinny_linear takes them (bf16 or an Fp8Matrix); out bf16, may be a column slice. M == 0 launches nothing."""
    problem = gated_unsupported_reason(out, x, weight)
    if problem is not None:
        raise InvalidArgument(f"skinny_gated: {problem}")
    m, k = x.shape
    if m == 0:
        return
    fp8 = isinstance(weight, Fp8Matrix)
    form = ("fp8_blocks" if weight.blocks else "fp8") if fp8 else "bf16"
    half = weight.shape[0] // 2
    launch_kernel(stream, lib.get(GATED_KERNELS[m <= 8, form], MODULE), ceil_div(2 * half, TILE_ROWS), THREADS, out,
                  np.int64(out.stride), x, np.int64(x.stride // 8), weight.data if fp8 else weight,
                  weight.scales if fp8 else NULL, m, half, k // 8)
