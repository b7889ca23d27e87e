"""Launcher for cuda_kernels/fp8.cu: a linear's input quantized to e4m3 for the W8A8 GEMM, per token or per token
and 128 columns."""

import numpy as np

from metrale.runtime.backend.cuda.fp8_matrix import BLOCK
from metrale.runtime.backend.cuda.launch import launch_kernel
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument

MODULE = "fp8"
THREADS = 256            # as in fp8.cu


def quantize_rows(lib, stream, q: DeviceTensor, scales: DeviceTensor, x: DeviceTensor) -> None:
    """q [M, K] e4m3 (contiguous) and scales [M] float32 from x [M, K] bf16 (a column slice may do): scales[r] =
    max |x[r]| / 448 (1 for a row of zeros), q[r] = x[r] / scales[r] rounded to nearest e4m3. K % 8 == 0, x 16-byte
    aligned (pointer and row stride)."""
    m, k = x.shape
    _check("quantize_rows", q, x, 8)
    if not (scales.dtype == "float32" and scales.shape == (m,)):
        raise InvalidArgument(f"quantize_rows: scales must be [{m}] float32, not {scales.shape} {scales.dtype}")
    if m == 0:
        return
    launch_kernel(stream, lib.get("quantize_rows_e4m3", MODULE), m, THREADS, q, scales, x, np.int64(x.stride // 8),
                  k // 8)


def quantize_groups(lib, stream, q: DeviceTensor, scales: DeviceTensor, x: DeviceTensor) -> None:
    """quantize_rows per BLOCK columns: scales [K / BLOCK, M] float32 (contiguous: a block's M scales together, as
    cuBLASLt's VEC128_32F reads them), scales[g, r] = max |x[r, BLOCK g:BLOCK (g + 1)]| / 448 (1 for zeros), q[r, c]
    = x[r, c] / scales[c // BLOCK, r] rounded to nearest e4m3. K % BLOCK == 0."""
    m, k = x.shape
    _check("quantize_groups", q, x, BLOCK)
    if not (scales.dtype == "float32" and scales.shape == (k // BLOCK, m) and scales.is_contiguous):
        raise InvalidArgument(f"quantize_groups: scales must be a contiguous [{k // BLOCK}, {m}] float32, not "
                              f"{scales.shape} {scales.dtype}")
    if m == 0:
        return
    launch_kernel(stream, lib.get("quantize_groups_e4m3", MODULE), m, THREADS, q, scales, x,
                  np.int64(x.stride // 8), k // 8, m)


def _check(name: str, q: DeviceTensor, x: DeviceTensor, k_multiple: int) -> None:
    """x a 16-byte aligned [M, K] bf16 with K % k_multiple == 0, q a contiguous aligned [M, K] e4m3."""
    m, k = x.shape
    # On the path of every W8A8 linear: plain comparisons, a message formatted only on failure.
    if not (x.dtype == "bfloat16" and k % k_multiple == 0 and (x.ptr | 2 * x.stride) % 16 == 0):
        raise InvalidArgument(f"{name}: x must be a 16-byte aligned [M, K] bfloat16 with K % {k_multiple} == 0, not "
                              f"{x.shape} {x.dtype} at {x.ptr:#x} stride {x.stride}")
    if not (q.dtype == "float8_e4m3" and q.shape == (m, k) and q.is_contiguous and q.ptr % 16 == 0):
        raise InvalidArgument(f"{name}: q must be a contiguous aligned [{m}, {k}] float8_e4m3, not {q.shape} "
                              f"{q.dtype}")
