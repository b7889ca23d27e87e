"""A linear's weight kept in FP8 on the device: e4m3 values with float32 scales, one a row, as `--quantize fp8`
makes them (loading/fp8.py) and as FP8 releases with one scale a tensor or a channel hold them; or one a row for
each 128 columns, as releases with 128 x 128 block scales (DeepSeek's, Qwen3's) hold them once their rows are picked
and joined (loading/fp8.py's Fp8Weight keeps a block's scale on each of its rows). linears.py multiplies one: decode
rows on the skinny GEMM (the weight widened to bf16 in registers: W8A16), more rows on cuBLASLt's FP8 matmul over
the input quantized per token (W8A8), and per token and 128 columns for a weight in blocks. Any other FP8 form (e5m2,
blocks of other sizes) is uploaded dequantized to bf16, as is every FP8 weight on a device or cuBLAS without those
scale modes (OUTER_VEC_32F, VEC128_32F: Hopper and later, cuBLAS 12.9 and later). A mixture's experts stack in
either form, for moe.cu's grouped GEMMs (W8A16 at every row count, no cuBLAS)."""

from dataclasses import dataclass

import torch

from metrale.runtime.backend.cuda.compiler import arch_number
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.loading.fp8 import KEPT_BLOCK, KEPT_K_MULTIPLE, Fp8Experts, Fp8Weight

# cuBLASLt's FP8 matmul takes K, and the skinny GEMM's 16-byte loads of a row, in multiples of 16.
K_MULTIPLE = KEPT_K_MULTIPLE
# The columns a scale of a weight in blocks covers (cuBLASLt's VEC128_32F; DeepSeek's weight_block_size [128, 128]).
BLOCK = KEPT_BLOCK
# cuBLASLt's version with OUTER_VEC_32F scales (cublasLtGetVersion's form of 12.9.0).
MIN_CUBLAS = 120900


@dataclass(frozen=True)
class Fp8Matrix:
    """weight [N, K] = data [N, K] (e4m3) x scales (float32): scales [N], row by row; or, in blocks (blocks=True),
    scales [K / BLOCK, N], element (r, c) times scales[c // BLOCK, r] (a column block's N scales together, as
    cuBLASLt's VEC128_32F takes them). A mixture's experts [E, N, K] (moe.cu's grouped GEMMs): scales [E, N], or in
    blocks [E, K / BLOCK, N]."""
    data: DeviceTensor
    scales: DeviceTensor
    blocks: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> str:
        return self.data.dtype


def kept_as_fp8(weight, arch: str, cublas_version: int) -> bool:
    """Whether a checkpoint weight goes to the device as an Fp8Matrix: an Fp8Weight of e4m3 values with one scale a
    row and K a multiple of K_MULTIPLE on Hopper or later, or with one a row per BLOCK columns and K a multiple of
    BLOCK on Hopper, with cuBLAS MIN_CUBLAS or later; a mixture's Fp8Experts with one scale a row and K a multiple of
    K_MULTIPLE, or one a row per BLOCK columns and K a multiple of BLOCK, on Hopper or later (moe.cu's kernels, no
    cuBLAS). (Any other weight is never asked for its parts: a GGUF BlockWeight would dequantize itself to answer.)"""
    if isinstance(weight, Fp8Experts):          # a mixture's experts: one scale a row, or a row's per block
        if arch_number(arch) < 90 or weight.data.dtype != torch.float8_e4m3fn:
            return False
        if weight.scales.shape[-1] == 1:
            return weight.shape[-1] % K_MULTIPLE == 0
        return weight.block == BLOCK and weight.shape[-1] % BLOCK == 0
    if not isinstance(weight, Fp8Weight) or arch_number(arch) < 90 or cublas_version < MIN_CUBLAS:
        return False
    data, scales = weight.data, weight.scales
    if data.dtype != torch.float8_e4m3fn:
        return False
    if tuple(scales.shape) == (data.shape[0], 1):
        return data.shape[1] % K_MULTIPLE == 0
    # cuBLASLt's VEC128_32F scales are Hopper's (Blackwell's block scales are other formats).
    return arch_number(arch) == 90 and weight.block == BLOCK and data.shape[1] % BLOCK == 0


def device_scales(weight: Fp8Weight | Fp8Experts) -> torch.Tensor:
    """A kept weight's scales as an Fp8Matrix holds them: [N] for one a row, [K / BLOCK, N] contiguous for blocks;
    experts' [E, N] and [E, K / BLOCK, N]. In blocks, one dimension more than one a row."""
    if weight.scales.shape[-1] == 1:
        return weight.scales[..., 0].contiguous()
    return weight.scales.transpose(-1, -2).contiguous()
