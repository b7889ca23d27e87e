"""What a cuBLASLt GEMM's descriptors depend on, apart from cuBLASLt itself: a linear's operands checked and
reduced to a cache key (LinearKey: the plain linear, its split-K partials, or one batch a head), and the
column-major layouts and operations (GemmPlan) that key asks of cuBLASLt."""

from dataclasses import dataclass
from typing import NamedTuple

from metrale.runtime.backend.cuda.fp8_matrix import BLOCK
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument

# cudaDataType_t values (library_types.h).
CUDA_DATA_TYPE = {"bfloat16": 14, "float32": 0, "float8_e4m3": 28}
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_RELU, CUBLASLT_EPILOGUE_BIAS = 1, 2, 4
CUBLASLT_EPILOGUE_RELU_BIAS = CUBLASLT_EPILOGUE_RELU | CUBLASLT_EPILOGUE_BIAS
# cublasLtMatmulMatrixScale_t: a float32 scale for each row of op(A) and each column of op(B) (an FP8 weight's rows,
# a quantized input's tokens); or one for each of those per 128 of K, [K / 128, rows or columns] (an FP8 weight in
# blocks, an input quantized per 128 columns).
CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F = 3
CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F = 4
# The FP8 matmul with VEC128_32F scales takes tokens in multiples of this (others: CUBLAS_STATUS_NOT_SUPPORTED).
VEC128_ROWS = 4
OUT_DTYPES = ("bfloat16", "float32")
# Every pointer and row stride is checked to this alignment, and the heuristic is told so: its default
# assumption is 256 bytes, and an algorithm picked under it may misbehave on a row view that is only 16-aligned.
ALIGNMENT = 16


class LinearKey(NamedTuple):
    """What a linear's descriptors and algorithm depend on: the cache key. Pointers are not part of it."""
    m: int            # rows of x and out (tokens)
    n: int            # rows of weight, columns of out
    k: int            # columns of x and weight
    x_stride: int     # elements between rows of x
    out_stride: int   # elements between rows of out
    out_dtype: str    # 'bfloat16' or 'float32' (logits)
    has_bias: bool
    relu: bool = False   # max(., 0) in the epilogue, after the bias
    # > 1: K in `splits` equal slices, each slice's product a float32 partial of its own (out [splits * M, N]: the
    # partials one after another), for a kernel after it to sum (a strided batched GEMM: no reduce kernel).
    splits: int = 1
    # > 1: a weight [heads, N, K] per head, head h's x and out columns x_head_stride and out_head_stride elements
    # after head h - 1's (a strided batched GEMM: one launch for every head of an attention layer).
    heads: int = 1
    x_head_stride: int = 0
    out_head_stride: int = 0
    transposed: bool = False     # the heads' weights stored [heads, K, N]
    fp8: bool = False            # x and weight e4m3, each with a float32 scale a row (W8A8: fp8_linear_key)
    blocks: bool = False         # fp8, each scale a row per 128 of K


@dataclass(frozen=True)
class MatrixLayout:
    """A column-major cuBLASLt matrix: rows x cols, column j at element offset j * ld."""
    dtype: str
    rows: int
    cols: int
    ld: int
    batch: int = 1          # strided batches: matrix i at element offset i * batch_stride
    batch_stride: int = 0


@dataclass(frozen=True)
class GemmPlan:
    """cuBLASLt computes D[m, n] = op(A) @ op(B), column-major. A row-major [R, C] buffer with row stride s is,
    read column-major, the [C, R] matrix with ld = s: its transpose, for free. So
        out[M, N] = x[M, K] @ weight[N, K].T   <=>   out.T[N, M] = weight[N, K] @ x.T[K, M]
    and every operand is already in memory in the form this needs:
        A = weight, read as [K, N] ld K, transposed (OP_T)  -> [N, K]
        B = x,      read as [K, M] ld x_stride (OP_N)        -> [K, M]
        D = out,    read as [N, M] ld out_stride             (C = D, beta = 0: never read)
    m = N, n = M, k = K: the "TN" GEMM, the layout cuBLASLt's fastest bf16 kernels take. The BIAS epilogue adds
    a vector as long as D's rows (N), broadcast over D's columns (tokens): bias[N], as nn.Linear adds it; the
    RELU epilogues then take max(., 0) before D is rounded to its type. Split in `splits` (LinearKey.splits), K's
    slice i is batch i: A and B move on by K / splits columns of the weight and of x, D by a whole [N, M] out."""
    a: MatrixLayout
    b: MatrixLayout
    d: MatrixLayout
    transa: int
    transb: int
    epilogue: int
    scale_mode: int | None = None    # the FP8 matmul's: A and B scaled by OUTER_VEC_32F or VEC128_32F vectors

    @classmethod
    def for_linear(cls, key: LinearKey) -> "GemmPlan":
        if key.fp8:             # the same TN GEMM (cuBLASLt's FP8 matmul takes no other) over e4m3 operands
            return cls(a=MatrixLayout("float8_e4m3", key.k, key.n, key.k),
                       b=MatrixLayout("float8_e4m3", key.k, key.m, key.x_stride),
                       d=MatrixLayout(key.out_dtype, key.n, key.m, key.out_stride), transa=CUBLAS_OP_T,
                       transb=CUBLAS_OP_N, epilogue=_EPILOGUES[key.has_bias, key.relu],
                       scale_mode=(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F if key.blocks
                                   else CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F))
        if key.heads > 1:       # batch h: weight[h], and x's and out's columns of head h
            # weight[h] [N, K] row-major is column-major [K, N], transposed; stored [K, N], it is [N, K] as it is
            a = (MatrixLayout("bfloat16", key.n, key.k, key.n, key.heads, key.n * key.k) if key.transposed
                 else MatrixLayout("bfloat16", key.k, key.n, key.k, key.heads, key.n * key.k))
            return cls(a=a, b=MatrixLayout("bfloat16", key.k, key.m, key.x_stride, key.heads, key.x_head_stride),
                       d=MatrixLayout(key.out_dtype, key.n, key.m, key.out_stride, key.heads, key.out_head_stride),
                       transa=CUBLAS_OP_N if key.transposed else CUBLAS_OP_T, transb=CUBLAS_OP_N,
                       epilogue=CUBLASLT_EPILOGUE_DEFAULT)
        slice_k, s = key.k // key.splits, key.splits
        return cls(a=MatrixLayout("bfloat16", slice_k, key.n, key.k, s, slice_k),
                   b=MatrixLayout("bfloat16", slice_k, key.m, key.x_stride, s, slice_k),
                   d=MatrixLayout(key.out_dtype, key.n, key.m, key.out_stride, s, key.m * key.out_stride),
                   transa=CUBLAS_OP_T, transb=CUBLAS_OP_N,
                   epilogue=_EPILOGUES[key.has_bias, key.relu])


_EPILOGUES = {(False, False): CUBLASLT_EPILOGUE_DEFAULT, (True, False): CUBLASLT_EPILOGUE_BIAS,
              (False, True): CUBLASLT_EPILOGUE_RELU, (True, True): CUBLASLT_EPILOGUE_RELU_BIAS}


def linear_key(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
               relu: bool = False, splits: int = 1) -> LinearKey:
    """Checks a linear's operands (shapes, dtypes, 16-byte alignment) and returns its cache key.
    On the hot path of every prefill linear: plain comparisons, and a message is formatted only on failure."""
    if splits != 1:
        return _split_key(out, x, weight, bias, relu, splits)
    if len(x.shape) != 2 or x.dtype != "bfloat16":
        raise InvalidArgument(f"linear: x must be [M, K] bfloat16, not {x.shape} {x.dtype}")
    if len(weight.shape) != 2 or weight.dtype != "bfloat16" or not weight.is_contiguous:
        raise InvalidArgument(f"linear: weight must be a contiguous [N, K] bfloat16, not {weight.shape} "
                              f"{weight.dtype} with row stride {weight.stride}")
    m, k = x.shape
    n = weight.shape[0]
    if n == 0 or k == 0:
        raise InvalidArgument(f"linear: weight {weight.shape} is empty")
    if weight.shape[1] != k:
        raise InvalidArgument(f"linear: x {x.shape} and weight {weight.shape} disagree on K")
    if out.shape != (m, n) or out.dtype not in OUT_DTYPES:
        raise InvalidArgument(f"linear: out must be [{m}, {n}] in one of {OUT_DTYPES}, not {out.shape} {out.dtype}")
    x_stride, out_stride = x.stride, out.stride
    if x_stride < k or out_stride < n:
        raise InvalidArgument(f"linear: a row stride is shorter than its row (x {x_stride} < {k} or out "
                              f"{out_stride} < {n})")
    if (x.ptr | weight.ptr | out.ptr | 2 * x_stride | 2 * k | out.itemsize * out_stride) % ALIGNMENT:
        raise InvalidArgument(f"linear: x, weight and out must be {ALIGNMENT}-byte aligned (pointer and row stride): "
                              f"x {x.ptr:#x} stride {x_stride}, weight {weight.ptr:#x} stride {k}, out "
                              f"{out.ptr:#x} stride {out_stride}")
    if bias is not None:
        # cuBLASLt's BIAS epilogue takes a bias of D's type only (a bf16 bias on float32 logits is INVALID_VALUE):
        # a biased float32 output needs the bias uploaded as float32.
        if bias.shape != (n,) or bias.dtype != out.dtype:
            raise InvalidArgument(f"linear: bias must be [{n}] {out.dtype} (out's dtype), not {bias.shape} "
                                  f"{bias.dtype}")
        if bias.ptr % ALIGNMENT:
            raise InvalidArgument(f"linear: bias must be {ALIGNMENT}-byte aligned, not {bias.ptr:#x}")
    return LinearKey(m, n, k, x_stride, out_stride, out.dtype, bias is not None, relu)


def _split_key(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None, relu: bool,
               splits: int) -> LinearKey:
    """linear_key for float32 partials over K's slices: out [splits * M, N] float32, contiguous; no bias or relu
    (they apply to the sum)."""
    if splits < 1:
        raise InvalidArgument(f"linear: splits must be at least 1, not {splits}")
    if bias is not None or relu:
        raise InvalidArgument(f"linear: {splits} split partials take no bias or relu (the sum's reader adds them)")
    if len(x.shape) != 2 or len(weight.shape) != 2:
        raise InvalidArgument(f"linear: x {x.shape} and weight {weight.shape} must be 2-D")
    m, k = x.shape
    if k % splits or (k // splits) % (ALIGNMENT // 2):
        raise InvalidArgument(f"linear: K={k} does not split into {splits} slices of a multiple of {ALIGNMENT // 2}")
    if out.dtype != "float32" or not out.is_contiguous or out.shape != (splits * m, weight.shape[0]):
        raise InvalidArgument(f"linear: {splits} split partials need out [{splits * m}, {weight.shape[0]}] float32 "
                              f"contiguous, not {out.shape} {out.dtype}")
    key = linear_key(DeviceTensor(out.ptr, (m, out.shape[1]), "float32"), x, weight, None)
    return key._replace(splits=splits)


def head_linear_key(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, x_head_stride: int,
                    out_head_stride: int, transposed: bool = False) -> LinearKey:
    """Checks a per-head linear's operands: weight [heads, N, K] (transposed: [heads, K, N]) contiguous bf16; x [M, K]
    and out [M, N] bf16, head 0's columns of tensors whose rows hold every head's (head h's x_head_stride and
    out_head_stride elements on); every head's pointer 16-byte aligned."""
    if len(weight.shape) != 3 or weight.dtype != "bfloat16" or not weight.is_contiguous:
        raise InvalidArgument(f"head linear: weight must be a contiguous [heads, N, K] bfloat16, not {weight.shape} "
                              f"{weight.dtype}")
    heads, n, k = (weight.shape[0], weight.shape[2], weight.shape[1]) if transposed else weight.shape
    key = linear_key(out, x, DeviceTensor(weight.ptr, (n, k), "bfloat16"), None)
    if out.dtype != "bfloat16":
        raise InvalidArgument(f"head linear: out must be bfloat16, not {out.dtype}")
    if x_head_stride < k or out_head_stride < n or (2 * x_head_stride | 2 * out_head_stride | 2 * n) % ALIGNMENT:
        raise InvalidArgument(f"head linear: head strides {x_head_stride} (x) and {out_head_stride} (out) must "
                              f"cover K={k} and N={n} and keep every head (and weight row) {ALIGNMENT}-byte "
                              f"aligned")
    if (heads - 1) * x_head_stride + k > x.stride or (heads - 1) * out_head_stride + n > out.stride:
        raise InvalidArgument(f"head linear: {heads} heads do not fit in rows of x {x.stride} and out {out.stride}")
    return key._replace(heads=heads, x_head_stride=x_head_stride, out_head_stride=out_head_stride,
                        transposed=transposed)


def fp8_linear_key(out: DeviceTensor, x: DeviceTensor, x_scales: DeviceTensor, data: DeviceTensor,
                   scales: DeviceTensor, bias: DeviceTensor | None, relu: bool = False, blocks: bool = False
                   ) -> LinearKey:
    """Checks a W8A8 linear's operands and returns its cache key: out [M, N] bf16 (a column slice may do) = (x [M, K]
    x x_scales [M]) @ (data [N, K] x scales [N]).T (+ bias [N] bf16): x and data contiguous e4m3, K % 16 == 0, every
    pointer and out's row stride 16-byte aligned. blocks: a scale a row per 128 of K, x_scales [K / 128, M] and
    scales [K / 128, N] (contiguous), K % 128 == 0, M % VEC128_ROWS == 0."""
    if len(x.shape) != 2 or x.dtype != "float8_e4m3" or not x.is_contiguous:
        raise InvalidArgument(f"FP8 linear: x must be a contiguous [M, K] float8_e4m3, not {x.shape} {x.dtype}")
    if len(data.shape) != 2 or data.dtype != "float8_e4m3" or not data.is_contiguous:
        raise InvalidArgument(f"FP8 linear: weight must be a contiguous [N, K] float8_e4m3, not {data.shape} "
                              f"{data.dtype}")
    m, k = x.shape
    n = data.shape[0]
    k_multiple = BLOCK if blocks else 16
    if data.shape[1] != k or n == 0 or k % k_multiple:
        raise InvalidArgument(f"FP8 linear: x {x.shape} and weight {data.shape} must agree on a K that is a "
                              f"multiple of {k_multiple}, with N > 0")
    if blocks and m % VEC128_ROWS:
        raise InvalidArgument(f"FP8 linear: {m} rows in {BLOCK}-column blocks; cuBLASLt takes them in multiples of "
                              f"{VEC128_ROWS}")
    want_x, want_w = ((k // BLOCK, m), (k // BLOCK, n)) if blocks else ((m,), (n,))
    if (x_scales.shape != want_x or scales.shape != want_w or x_scales.dtype != "float32" or scales.dtype != "float32"
            or not (x_scales.is_contiguous and scales.is_contiguous)):
        raise InvalidArgument(f"FP8 linear: scales must be contiguous {list(want_x)} and {list(want_w)} float32, not "
                              f"{x_scales.shape} {x_scales.dtype} and {scales.shape} {scales.dtype}")
    if out.shape != (m, n) or out.dtype != "bfloat16" or out.stride < n:
        raise InvalidArgument(f"FP8 linear: out must be [{m}, {n}] bfloat16, not {out.shape} {out.dtype}")
    if (x.ptr | data.ptr | out.ptr | 2 * out.stride | x_scales.ptr | scales.ptr) % ALIGNMENT:
        raise InvalidArgument(f"FP8 linear: x, weight, out and the scales must be {ALIGNMENT}-byte aligned")
    if bias is not None and (bias.shape != (n,) or bias.dtype != "bfloat16" or bias.ptr % ALIGNMENT):
        raise InvalidArgument(f"FP8 linear: bias must be an aligned [{n}] bfloat16, not {bias.shape} {bias.dtype}")
    return LinearKey(m, n, k, k, out.stride, "bfloat16", bias is not None, relu, fp8=True, blocks=blocks)
