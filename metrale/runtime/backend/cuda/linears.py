"""Which GEMM runs a linear on the CUDA backend: the skinny-GEMM kernel for a few rows, cuBLASLt otherwise, and at
decode row counts the K-split form (float32 partials of K's slices) that a norm or the attention kernel sums. An FP8
weight (fp8_matrix.py): the skinny GEMM for a few rows, else cuBLASLt's FP8 matmul over the input quantized per
token (and per 128 columns for a weight in blocks); never split. A dense gated MLP's gate/up at decode rows takes
its activation into the same skinny launch (gated_fits)."""

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.fp8_matrix import BLOCK, Fp8Matrix
from metrale.runtime.backend.cuda.gemm_plan import VEC128_ROWS
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument

# Linears of at most this many rows with weights of at most this many elements run on the skinny-GEMM kernel:
# on an H200 (bench/gpu_skinny_gemm.py) it beats cuBLASLt by 1.05-1.13x on 6144 x 4096 and 4096 x 4096 and by
# 1.4-2.0x on small matrices at 1 to 8 rows, and trails on 4096 x 28672, the 128k-vocab lm_head and 16 rows. On
# 4096 x 14336 it trails alone (0.81x, its activation loads being plain loads for PDL) but not in a step:
# routing that shape to cuBLASLt (split-K plus a reduce kernel) left the Llama batch-1 step unchanged.
SKINNY_MAX_M = 8
SKINNY_MAX_WEIGHT = 64 << 20
# The split-K partials a linear hands the norm that reads it (layer_math.py; timed by bench/gpu_gemm_algos.py
# --splits): K's slices by rows, for K up to SPLIT_LONG_K and past it. Past 64 rows only a long K pays for the
# norm's reads of the partials (fc2 at 256 rows: 9.4 -> 6.3 us with 4 slices; a 1024 x 1024 linear: 4.1 -> 3.7 us,
# less than the norm's extra).
SPLIT_LONG_K = 2048
SPLITS_BY_ROWS = ((SKINNY_MAX_M, 1, 1), (64, 4, 8), (256, 1, 4))      # (up to rows, short K, long K)


def k_splits(rows: int, weight: DeviceTensor | Fp8Matrix) -> int:
    """The K slices a linear of `rows` rows hands its reader as partials (SPLITS_BY_ROWS), 1 for none: slices of
    whole 16-byte units only, as the split GEMM needs; none for an FP8 weight."""
    if isinstance(weight, Fp8Matrix):
        return 1
    k = weight.shape[1]
    splits = next(((short, long)[k > SPLIT_LONG_K] for most, short, long in SPLITS_BY_ROWS if rows <= most), 1)
    return 1 if k % (8 * splits) else splits


def linear_into(lib, gemm, ctx, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor | Fp8Matrix,
                bias: DeviceTensor | None = None, relu: bool = False) -> None:
    """out = x @ weight.T (+ bias, then relu): decode-sized linears on the skinny-GEMM kernel where it beats
    cuBLASLt, the rest on cuBLASLt (either takes the relu in its epilogue)."""
    if isinstance(weight, Fp8Matrix):
        fp8_linear_into(lib, gemm, ctx, out, x, weight, bias, relu)
    elif (x.shape[0] <= SKINNY_MAX_M and weight.numel <= SKINNY_MAX_WEIGHT
            and kernels.skinny_gemm.supports(x, weight, out, bias)):
        kernels.skinny_gemm.skinny_linear(lib, ctx.stream, out, x, weight, bias, relu=relu)
    else:
        gemm.linear(ctx.stream, out, x, weight, bias, ctx.gemm_workspace, relu=relu)


def gated_fits(x: DeviceTensor, weight: DeviceTensor | Fp8Matrix) -> bool:
    """Whether a dense gated MLP's gate/up [gate; up] and its activation run as one skinny launch (skinny_gated)
    into a bf16 out from the ring: at the rows linear_into gives the skinny GEMM (FP8: up to 16), whatever the
    weight's size, since the fused launch also saves the activation's launch and the [M, 2 I] product's round
    trip (Llama-3-8B's gate/up at one row: 58 us on it, 61 on cuBLASLt, plus silu_mul)."""
    rows = kernels.skinny_gemm.MAX_M if isinstance(weight, Fp8Matrix) else SKINNY_MAX_M
    return x.shape[0] <= rows and kernels.skinny_gemm.gated_inputs_reason(x, weight) is None


def fp8_linear_into(lib, gemm, ctx, out: DeviceTensor, x: DeviceTensor, weight: Fp8Matrix,
                    bias: DeviceTensor | None = None, relu: bool = False) -> None:
    """out = x @ weight.T (+ bias, then relu) for an FP8 weight: up to 16 rows on the skinny GEMM (the weight
    widened to bf16 in registers: exact to the bf16 weight it dequantizes to); more on cuBLASLt's FP8 matmul, x first
    quantized per token (and 128 columns, for a weight in blocks) into the stream's fp8_input."""
    m, k = x.shape
    if m <= kernels.skinny_gemm.MAX_M:
        kernels.skinny_gemm.skinny_linear(lib, ctx.stream, out, x, weight, bias, relu=relu)
        return
    if ctx.fp8_input is None or k > ctx.fp8_input.shape[1] or m > ctx.fp8_input.shape[0]:
        raise InvalidArgument(f"an FP8 linear's input [{m}, {k}] does not fit the stream's FP8 input buffer "
                              f"{None if ctx.fp8_input is None else ctx.fp8_input.shape} (MemoryShapes.fp8_width)")
    if weight.blocks:
        _fp8_blocks_linear_into(lib, gemm, ctx, out, x, weight, bias, relu)
        return
    quantized = DeviceTensor(ctx.fp8_input.ptr, (m, k), "float8_e4m3")
    scales = ctx.fp8_scales.rows(0, m)
    kernels.fp8.quantize_rows(lib, ctx.stream, quantized, scales, x)
    gemm.fp8_linear(ctx.stream, out, quantized, scales, weight, bias, ctx.gemm_workspace, relu=relu)


def _fp8_blocks_linear_into(lib, gemm, ctx, out: DeviceTensor, x: DeviceTensor, weight: Fp8Matrix,
                            bias: DeviceTensor | None, relu: bool) -> None:
    """fp8_linear_into's W8A8 path for a weight in blocks: x quantized per token and 128 columns (scales [K / 128,
    M]), then cuBLASLt's VEC128_32F matmul, which takes tokens in multiples of VEC128_ROWS: the last M %
    VEC128_ROWS rows (a prefill of another count; decode graphs pad to powers of two) run on the skinny GEMM (W8A16,
    one more pass over the weight)."""
    m, k = x.shape
    body = m - m % VEC128_ROWS
    quantized = DeviceTensor(ctx.fp8_input.ptr, (body, k), "float8_e4m3")
    scales = DeviceTensor(ctx.fp8_scales.ptr, (k // BLOCK, body), "float32")
    kernels.fp8.quantize_groups(lib, ctx.stream, quantized, scales, x.rows(0, body))
    gemm.fp8_linear(ctx.stream, out.rows(0, body), quantized, scales, weight, bias, ctx.gemm_workspace, relu=relu)
    if body < m:
        kernels.skinny_gemm.skinny_linear(lib, ctx.stream, out.rows(body, m), x.rows(body, m), weight, bias,
                                          relu=relu)


def partials(gemm, ctx, x: DeviceTensor, weight: DeviceTensor, splits: int) -> DeviceTensor:
    """x @ weight.T as `splits` K slices' float32 partials [splits * rows, N] (no bias), in the stream's ring."""
    out = ctx.new(splits * x.shape[0], weight.shape[0], "float32")
    gemm.linear(ctx.stream, out, x, weight, workspace=ctx.gemm_workspace, splits=splits)
    return out
