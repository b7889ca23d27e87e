"""Launcher for cuda_kernels/fp8.cu: a linear's input quantized per token to e4m3 for the W8A8 GEMM."""

import numpy as np

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
    # On the path of every W8A8 linear: plain comparisons, a message formatted only on failure.
    if not (x.dtype == "bfloat16" and k % 8 == 0 and (x.ptr | 2 * x.stride) % 16 == 0):
        raise InvalidArgument(f"quantize_rows: x must be a 16-byte aligned [M, K] bfloat16 with K % 8 == 0, not "
                              f"{x.shape} {x.dtype} at {x.ptr:#x} stride {x.stride}")
    if not (q.dtype == "float8_e4m3" and q.shape == (m, k) and q.is_contiguous and q.ptr % 16 == 0):
        raise InvalidArgument(f"quantize_rows: q must be a contiguous aligned [{m}, {k}] float8_e4m3, not {q.shape} "
                              f"{q.dtype}")
    if not (scales.dtype == "float32" and scales.shape == (m,)):
        raise InvalidArgument(f"quantize_rows: scales must be [{m}] float32, not {scales.shape} {scales.dtype}")
    if m == 0:
        return
    launch_kernel(stream, lib.get("quantize_rows_e4m3", MODULE), m, THREADS, q, scales, x, np.int64(x.stride // 8),
                  k // 8)
