"""A linear's weight kept in FP8 on the device: e4m3 values with one float32 scale a row, as `--quantize fp8` makes
them (loading/fp8.py) and as FP8 releases with a per-tensor or per-channel scale hold them. linears.py multiplies
one: decode rows on the skinny GEMM (the weight widened to bf16 in registers: W8A16), more rows on cuBLASLt's FP8
matmul over the input quantized per token (W8A8). Any other FP8 form (128 x 128 block scales, e5m2) is uploaded
dequantized to bf16, as before."""

from dataclasses import dataclass

import torch

from metrale.runtime.backend.cuda.tensor import DeviceTensor

# cuBLASLt's FP8 matmul takes K, and the skinny GEMM's 8-byte chunks of a row, in multiples of 16.
K_MULTIPLE = 16


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


def kept_as_fp8(weight, arch: str) -> bool:
    """Whether a checkpoint weight (an Fp8Weight) goes to the device as an Fp8Matrix: e4m3, one scale a row, K a
    multiple of K_MULTIPLE, on an architecture with FP8 conversions and tensor cores (sm_89 and later)."""
    data, scales = getattr(weight, "data", None), getattr(weight, "scales", None)
    return (data is not None and scales is not None and data.dtype == torch.float8_e4m3fn and data.dim() == 2
            and tuple(scales.shape) == (data.shape[0], 1) and data.shape[1] % K_MULTIPLE == 0
            and int(arch[3:].rstrip("af")) >= 89)
