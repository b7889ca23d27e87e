"""A linear's weight kept in FP8 on the device: e4m3 values with one float32 scale a row, as `--quantize fp8` makes
them (loading/fp8.py) and as FP8 releases with one scale a tensor hold them. linears.py multiplies one: decode rows on
the skinny GEMM (the weight widened to bf16 in registers: W8A16), more rows on cuBLASLt's FP8 matmul over the input
quantized per token (W8A8). Any other FP8 form (128 x 128 block scales, e5m2) is uploaded dequantized to bf16, as
before; so is every FP8 weight on a device or cuBLAS without that matmul's scale a row (OUTER_VEC_32F: Hopper and
later, cuBLAS 12.9 and later)."""

from dataclasses import dataclass

import torch

from metrale.runtime.backend.cuda.compiler import arch_number
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.loading.fp8 import Fp8Weight

# cuBLASLt's FP8 matmul takes K, and the skinny GEMM's 16-byte loads of a row, in multiples of 16.
K_MULTIPLE = 16
# cuBLASLt's version with OUTER_VEC_32F scales (cublasLtGetVersion's form of 12.9.0).
MIN_CUBLAS = 120900


@dataclass(frozen=True)
class Fp8Matrix:
    """weight [N, K] = data [N, K] (e4m3) x scales [N] (float32), row by row."""
    data: DeviceTensor
    scales: DeviceTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> str:
        return self.data.dtype


def kept_as_fp8(weight, arch: str, cublas_version: int) -> bool:
    """Whether a checkpoint weight goes to the device as an Fp8Matrix: an Fp8Weight of e4m3 values with one scale a
    row and K a multiple of K_MULTIPLE, on Hopper or later with cuBLAS MIN_CUBLAS or later. (Any other weight is
    never asked for its parts: a GGUF BlockWeight would dequantize itself to answer.)"""
    if not isinstance(weight, Fp8Weight) or arch_number(arch) < 90 or cublas_version < MIN_CUBLAS:
        return False
    data, scales = weight.data, weight.scales
    return (data.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (data.shape[0], 1)
            and data.shape[1] % K_MULTIPLE == 0)
