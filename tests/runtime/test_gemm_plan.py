"""The CUDA GEMM's host side, without a GPU: operand checks, the cache key, and the column-major mapping
(cuBLASLt's D = op(A) @ op(B) read over our row-major buffers, replayed in numpy, must be x @ weight.T + bias)."""

import numpy as np
import pytest
import torch

from metrale.runtime.backend.cuda.gemm import CublasLt
from metrale.runtime.backend.cuda.gemm_plan import (CUBLAS_OP_N, CUBLAS_OP_T, CUBLASLT_EPILOGUE_BIAS,
                                                    CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_RELU,
                                                    CUBLASLT_EPILOGUE_RELU_BIAS,
                                                    CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                                                    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, GemmPlan, LinearKey,
                                                    MatrixLayout, fp8_linear_key, linear_key)
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import FailedPrecondition, InvalidArgument

BASE = 1 << 20   # a fake, 256-byte aligned device address; linear_key never dereferences pointers


def tensor(shape, dtype="bfloat16", ptr=BASE, row_stride=None):
    return DeviceTensor(ptr, tuple(shape), dtype, row_stride)


def operands(m=7, n=1536, k=576, out_dtype="bfloat16", bias=True):
    return (tensor((m, n), out_dtype, ptr=BASE * 64), tensor((m, k), ptr=BASE * 16), tensor((n, k), ptr=BASE * 32),
            tensor((n,), out_dtype, ptr=BASE * 48) if bias else None)


def column_major(buffer: np.ndarray, layout: MatrixLayout) -> np.ndarray:
    """The rows x cols matrix cuBLASLt reads from `buffer` (flat): element (i, j) at i + j * ld."""
    size = buffer.itemsize
    return np.lib.stride_tricks.as_strided(buffer, (layout.rows, layout.cols), (size, layout.ld * size))


@pytest.mark.parametrize("m,n,k,x_pad,out_pad", [(1, 1536, 576, 0, 0), (7, 48, 32, 16, 8), (300, 64, 40, 8, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_column_major_plan_computes_linear(m, n, k, x_pad, out_pad, with_bias):
    rng = np.random.default_rng(m * 1000 + n)
    x_wide = rng.standard_normal((m, k + x_pad))
    x = x_wide[:, x_pad:]                               # a column slice: row stride k + x_pad
    weight = rng.standard_normal((n, k))
    bias = rng.standard_normal(n) if with_bias else None
    out_wide = np.full((m, n + out_pad), np.nan)
    out = tensor((m, n), row_stride=n + out_pad)
    key = linear_key(out, tensor((m, k), row_stride=k + x_pad), tensor((n, k)), tensor((n,)) if with_bias else None)
    plan = GemmPlan.for_linear(key)

    # BLAS semantics over the same memory the kernel will see: each operand from its buffer's start.
    a = column_major(weight.reshape(-1), plan.a)
    b = column_major(x_wide.reshape(-1)[x_pad:], plan.b)
    d = column_major(out_wide.reshape(-1), plan.d)
    op_a = a.T if plan.transa == CUBLAS_OP_T else a
    op_b = b.T if plan.transb == CUBLAS_OP_T else b
    d[...] = op_a @ op_b
    if plan.epilogue == CUBLASLT_EPILOGUE_BIAS:
        d += bias[:, None]                              # BIAS: one value per row of D

    expected = x @ weight.T + (bias if with_bias else 0)
    np.testing.assert_allclose(out_wide[:, :n], expected, rtol=1e-12, atol=1e-12)
    assert np.isnan(out_wide[:, n:]).all()              # the padding columns of out are never written
    assert plan.epilogue == (CUBLASLT_EPILOGUE_BIAS if with_bias else CUBLASLT_EPILOGUE_DEFAULT)


@pytest.mark.parametrize("m,n,k,splits,x_pad", [(64, 48, 64, 4, 0), (3, 40, 96, 2, 8), (5, 16, 32, 1, 0)])
def test_split_plan_writes_each_slices_partial(m, n, k, splits, x_pad):
    """K in `splits` slices as strided batches: batch i reads the weight's and x's columns of slice i and writes
    its float32 partial as rows i * M .. of out; the partials sum to x @ weight.T."""
    rng = np.random.default_rng(m + n + k)
    x_wide = rng.standard_normal((m, k + x_pad))
    weight = rng.standard_normal((n, k))
    out = np.full((splits * m, n), np.nan)
    key = linear_key(tensor((splits * m, n), "float32"), tensor((m, k), row_stride=k + x_pad), tensor((n, k)), None,
                     splits=splits)
    plan = GemmPlan.for_linear(key)
    assert key.splits == splits and plan.epilogue == CUBLASLT_EPILOGUE_DEFAULT and plan.d.dtype == "float32"
    for i in range(splits):
        a = column_major(weight.reshape(-1)[i * plan.a.batch_stride:], plan.a)
        b = column_major(x_wide.reshape(-1)[x_pad:][i * plan.b.batch_stride:], plan.b)
        d = column_major(out.reshape(-1)[i * plan.d.batch_stride:], plan.d)
        d[...] = a.T @ b
        slice_k = slice(i * k // splits, (i + 1) * k // splits)
        np.testing.assert_allclose(out[i * m:(i + 1) * m], x_wide[:, x_pad:][:, slice_k] @ weight[:, slice_k].T,
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.reshape(splits, m, n).sum(0), x_wide[:, x_pad:] @ weight.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, message", [
    (dict(bias=True), "no bias"), (dict(relu=True), "no bias or relu"), (dict(k=100), "does not split"),
    (dict(out_dtype="bfloat16"), "float32"), (dict(out_rows=7), "float32"), (dict(flat_x=True), "2-D"),
    (dict(splits=0), "at least 1")])
def test_split_key_rejects_what_it_cannot_do(change, message):
    m, n, k, splits = 8, 32, change.get("k", 128), change.get("splits", 4)
    out = tensor((change.get("out_rows", splits * m), n), change.get("out_dtype", "float32"))
    bias = tensor((n,), "float32") if change.get("bias") else None
    x = tensor((m * k,)) if change.get("flat_x") else tensor((m, k))
    with pytest.raises(InvalidArgument, match=message):
        linear_key(out, x, tensor((n, k)), bias, change.get("relu", False), splits)


@pytest.mark.parametrize("with_bias", [False, True])
def test_relu_is_its_own_plan_and_epilogue(with_bias):
    out, x, weight = tensor((7, 48)), tensor((7, 32)), tensor((48, 32))
    bias = tensor((48,)) if with_bias else None
    plain, relu = linear_key(out, x, weight, bias), linear_key(out, x, weight, bias, relu=True)
    assert plain != relu and relu.relu and not plain.relu
    assert GemmPlan.for_linear(relu).epilogue == (CUBLASLT_EPILOGUE_RELU_BIAS if with_bias else CUBLASLT_EPILOGUE_RELU)
    assert GemmPlan.for_linear(relu).epilogue & CUBLASLT_EPILOGUE_BIAS == GemmPlan.for_linear(plain).epilogue & \
        CUBLASLT_EPILOGUE_BIAS


def test_key_ignores_pointers_and_sees_strides_dtype_and_bias():
    out, x, weight, bias = operands()
    moved = [DeviceTensor(t.ptr + 4096, t.shape, t.dtype, t.row_stride) for t in (out, x, weight, bias)]
    assert linear_key(out, x, weight, bias) == linear_key(*moved)
    assert linear_key(out, x, weight, bias) != linear_key(out, x, weight, None)
    assert linear_key(*operands(out_dtype="float32")) != linear_key(*operands())
    wide_x = tensor((7, 576), ptr=BASE * 16, row_stride=640)
    assert linear_key(out, wide_x, weight, bias).x_stride == 640
    assert linear_key(out, x, weight, bias) == (7, 1536, 576, 576, 1536, "bfloat16", True, False, 1, 1, 0, 0, False,
                                                False, False)


def test_an_fp8_linear_is_the_same_tn_gemm_over_e4m3_with_a_scale_a_row():
    m, n, k = 40, 1536, 576
    x, data = tensor((m, k), "float8_e4m3", ptr=BASE * 16), tensor((n, k), "float8_e4m3", ptr=BASE * 32)
    x_scales, scales = tensor((m,), "float32", ptr=BASE * 80), tensor((n,), "float32", ptr=BASE * 96)
    out, bias = tensor((m, n), ptr=BASE * 64, row_stride=n + 64), tensor((n,), ptr=BASE * 48)
    key = fp8_linear_key(out, x, x_scales, data, scales, bias, relu=True)
    assert key == LinearKey(m, n, k, k, n + 64, "bfloat16", True, True, fp8=True)
    plan = GemmPlan.for_linear(key)
    assert plan.scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
    assert (plan.transa, plan.transb, plan.epilogue) == (CUBLAS_OP_T, CUBLAS_OP_N, CUBLASLT_EPILOGUE_RELU_BIAS)
    assert (plan.a, plan.b, plan.d) == (MatrixLayout("float8_e4m3", k, n, k), MatrixLayout("float8_e4m3", k, m, k),
                                        MatrixLayout("bfloat16", n, m, n + 64))
    assert GemmPlan.for_linear(linear_key(*operands())).scale_mode is None
    bad = {"x in bf16": (out, tensor((m, k)), x_scales, data, scales, None),
           "K not a multiple of 16": (out, tensor((m, 8), "float8_e4m3"), x_scales, tensor((n, 8), "float8_e4m3"),
                                      scales, None),
           "a scale a block": (out, x, x_scales, data, tensor((n, 5), "float32"), None),
           "float32 out": (tensor((m, n), "float32"), x, x_scales, data, scales, None),
           "unaligned scales": (out, x, tensor((m,), "float32", ptr=BASE + 4), data, scales, None)}
    for case, operands_ in bad.items():
        with pytest.raises(InvalidArgument, match="FP8 linear"):
            fp8_linear_key(*operands_)
            pytest.fail(case)


def test_an_fp8_linear_in_blocks_scales_a_row_per_128_of_k():
    """A weight in blocks: the input's scales [K / 128, M] and the weight's [K / 128, N], each VEC128_32F."""
    m, n, k = 40, 1536, 640
    x, data = tensor((m, k), "float8_e4m3", ptr=BASE * 16), tensor((n, k), "float8_e4m3", ptr=BASE * 32)
    x_scales, scales = tensor((5, m), "float32", ptr=BASE * 80), tensor((5, n), "float32", ptr=BASE * 96)
    out = tensor((m, n), ptr=BASE * 64)
    key = fp8_linear_key(out, x, x_scales, data, scales, None, blocks=True)
    assert key == LinearKey(m, n, k, k, n, "bfloat16", False, False, fp8=True, blocks=True)
    assert GemmPlan.for_linear(key).scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
    bad = {"a scale a row": (out, x, tensor((m,), "float32"), data, tensor((n,), "float32")),
           "scales transposed": (out, x, tensor((m, 5), "float32"), data, tensor((n, 5), "float32")),
           "K not a multiple of 128": (out, tensor((m, 576), "float8_e4m3"), tensor((4, m), "float32"),
                                       tensor((n, 576), "float8_e4m3"), tensor((4, n), "float32")),
           "M not a multiple of 4": (tensor((m - 1, n)), tensor((m - 1, k), "float8_e4m3", ptr=BASE * 16),
                                     tensor((5, m - 1), "float32", ptr=BASE * 80), data, scales)}
    for case, operands_ in bad.items():
        with pytest.raises(InvalidArgument, match="FP8 linear"):
            fp8_linear_key(*operands_, None, blocks=True)
            pytest.fail(case)


def test_a_head_linear_is_one_batch_a_head():
    """Multi-head latent attention's per-head projections (DeepSeek-V3: 128 heads, the query's 128 dims of its
    head's 192 onto the 512 of the latent, into rows of 576 a head): batch h reads weight[h], x's and out's columns
    of head h."""
    from metrale.runtime.backend.cuda.gemm_plan import head_linear_key
    heads, n, k = 128, 512, 128
    x = tensor((7, k), ptr=BASE * 16, row_stride=heads * 192)
    out = tensor((7, n), ptr=BASE * 64, row_stride=heads * 576)
    weight = tensor((heads, n, k), ptr=BASE * 128)
    key = head_linear_key(out, x, weight, 192, 576)
    assert (key.heads, key.x_head_stride, key.out_head_stride) == (heads, 192, 576)
    plan = GemmPlan.for_linear(key)
    assert (plan.a.batch, plan.a.batch_stride, plan.a.rows, plan.a.cols) == (heads, n * k, k, n)
    assert (plan.b.batch, plan.b.batch_stride, plan.b.ld) == (heads, 192, heads * 192)
    assert (plan.d.batch, plan.d.batch_stride, plan.d.rows, plan.d.cols, plan.d.ld) == (heads, 576, n, 7, heads * 576)
    # weight[h] stored [K, N] (a latent's up-projection, k_up [heads, 128, 512], folded into the query)
    transposed = head_linear_key(out, x, tensor((heads, k, n), ptr=BASE * 128), 192, 576, transposed=True)
    plan = GemmPlan.for_linear(transposed)
    assert (plan.a.rows, plan.a.cols, plan.a.ld, plan.transa) == (n, k, n, CUBLAS_OP_N)
    with pytest.raises(InvalidArgument, match="do not fit"):
        head_linear_key(out, x, weight, 193 + 7, 576)
    with pytest.raises(InvalidArgument, match="aligned"):
        head_linear_key(out, x, weight, 196, 576)


@pytest.mark.parametrize("change,message", [
    ({"x": tensor((7, 512))}, "disagree on K"),
    ({"out": tensor((7, 1535), ptr=BASE * 64)}, "out must be"),
    ({"out": tensor((7, 1536), "float16", ptr=BASE * 64)}, "out must be .* in one of"),
    ({"x": tensor((7, 576), "float32")}, "x must be"),
    ({"weight": tensor((1536, 576), row_stride=640)}, "contiguous"),
    ({"bias": tensor((1535,))}, "bias must be"),
    ({"bias": tensor((1536,), "float32")}, "bias must be"),
    ({"out": tensor((7, 1536), "float32", ptr=BASE * 64)}, "bias must be .* float32"),   # bf16 bias, fp32 logits
    ({"bias": tensor((1536,), ptr=BASE + 2)}, "aligned"),
    ({"x": tensor((7, 576), ptr=BASE + 2, row_stride=640)}, "aligned"),         # a column slice starting at 1
    ({"x": tensor((7, 576), row_stride=580)}, "aligned"),                         # a row stride of 1160 bytes
    ({"out": tensor((7, 1536), ptr=BASE + 8, row_stride=1540)}, "aligned"),
    ({"weight": tensor((1536, 0)), "x": tensor((7, 0))}, "empty"),
])
def test_key_rejects_bad_operands(change, message):
    out, x, weight, bias = operands()
    arguments = {"out": out, "x": x, "weight": weight, "bias": bias} | change
    with pytest.raises(InvalidArgument, match=message):
        linear_key(**arguments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_cublaslt_without_a_gpu_is_a_failed_precondition():
    # Without nvmath-python, without libcublasLt, or without a driver: one actionable error, raised at creation.
    with pytest.raises(FailedPrecondition, match="nvmath-python|libcublasLt|cuBLASLt is not usable"):
        CublasLt(tensor((32 << 20,), "uint8"))


def test_workspace_is_checked_before_anything_loads():
    with pytest.raises(InvalidArgument, match="workspace"):
        CublasLt(tensor((1024,), "bfloat16"))
    with pytest.raises(InvalidArgument, match="256-byte"):
        CublasLt(tensor((1024,), "uint8", ptr=BASE + 16))
