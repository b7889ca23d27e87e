"""QuantizedWeight (the CPU backend's packed GGUF blocks) against the dequantized weight, and the CPU layer math's
dispatch on it."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from metrale.runtime.backend.cpu.layer_math import CpuLayerMath
from metrale.runtime.backend.cpu.quantized import QuantizedWeight
from metrale.runtime.loading.gguf_blocks import KINDS, OFFSETS, BlockWeight
from block_bytes import quantize

U = 2.0 ** -9       # bf16's unit roundoff (8 significant bits, round to nearest)


def _blocks(kind: str, rows: int, columns: int, seed: int = 0) -> BlockWeight:
    """Rows of random weights, off zero where a kind has mins of its own, so that they and the zeros matter."""
    weight = np.random.default_rng(seed).normal(0.0, 0.5, (rows, columns)).astype(np.float32)
    if kind not in OFFSETS and kind != "Q8_0":
        weight += np.linspace(-1.0, 1.0, rows, dtype=np.float32)[:, None]
    return BlockWeight.from_gguf(kind, quantize(weight, kind), rows, columns)


def _reach(blocks: BlockWeight) -> torch.Tensor:
    """r [rows, columns]: an element's packed weight is off the dequantized one by at most U r, where the kernel's
    code c stands for (c - 8) scale + zero with scale and zero in bf16. 4 and 5 bits: |q - 8| |scale| +
    |min + 8 scale| (a 5-bit code's high half adds 16 h bf16(scale), exactly); Q8_0, whose scales and zeros are d
    times powers of two: |q d|, the weight itself."""
    scales = blocks.scales.abs().repeat_interleave(32, dim=1)
    codes = blocks.unpacked_codes().float()
    if blocks.kind == "Q8_0":
        return codes.abs() * scales
    return (codes - 8).abs() * scales + (blocks.mins + 8 * blocks.scales).abs().repeat_interleave(32, dim=1)


def _bf16_rounded_weight(blocks: BlockWeight) -> torch.Tensor:
    """The weight the kernel multiplies: (c - 8) bf16(scale) + bf16(min + 8 scale) for 4-bit codes, that plus
    16 h bf16(scale) for a 5-bit c = 16 h + l (the two halves' sum, rounded in float32 as the kernel sums them), or
    q bf16(d) (exact)."""
    scales = blocks.scales.bfloat16().float().repeat_interleave(32, dim=1)
    codes = blocks.unpacked_codes()
    if blocks.kind == "Q8_0":
        return codes.float() * scales
    zeros = (blocks.mins + 8 * blocks.scales).bfloat16().float().repeat_interleave(32, dim=1)
    low = ((codes & 0x0F).float() - 8) * scales + zeros
    return low if blocks.bits == 4 else 16 * (codes >> 4).float() * scales + low


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [64, 40])        # 40: padded to the kernel's multiple of 16 rows
def test_linear_multiplies_the_weight_with_bf16_scales_and_zeros_exactly(kind, rows):
    """The identity as x: each output is one weight, which the kernel computes exactly and rounds to bf16 once (Q8_0:
    its two 4-bit halves sum to q bf16(d) with no rounding)."""
    blocks = _blocks(kind, rows, 256)
    out = QuantizedWeight(blocks).linear(torch.eye(256))
    assert out.shape == (256, rows) and out.dtype == torch.float32
    assert torch.equal(out, _bf16_rounded_weight(blocks).T.bfloat16().float())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_linear_is_within_the_rounding_bound_of_the_dequantized_weight(kind, tokens):
    """x already in bf16, against F.linear on the float32 dequantized weight: |out - y| <= U |y| (the product
    rounded to bf16) + U |x| r (bf16 scales and zeros, _reach) + the two float32 sums' rounding, at most
    2 K 2^-24 |x| (|w| + 32 |scale|) (K: the packed columns, 2 x 256 at most; 32 |scale|: the most a 5- or 8-bit
    weight's two packed terms exceed |w| by). A wrong code, scale or zero is off by about |x| scale, far past it."""
    blocks = _blocks(kind, 48, 256, seed=tokens)
    weight, quantized = blocks.dequantize(), QuantizedWeight(blocks)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    bias = torch.randn(48)
    expected = F.linear(x, weight, bias)
    d = blocks.scales.abs().repeat_interleave(32, dim=1)
    bound = (U * (expected - bias).abs() + 1.01 * U * (x.abs() @ _reach(blocks).T)
             + 2 * 512 * 2.0 ** -24 * (x.abs() @ (weight.abs() + 32 * d).T) + 1e-6)
    out = quantized.linear(x, bias)
    assert out.dtype == torch.float32 and ((out - expected).abs() <= bound).all()
    assert (out - expected).abs().max() > 0         # the bound is met by rounding, not by an exact float32 path


def test_linear_answers_in_the_dtype_of_x():
    quantized = QuantizedWeight(_blocks("Q8_0", 32, 64))
    x = torch.randn(3, 64)
    assert quantized.linear(x.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(quantized.linear(x.bfloat16()).float(), quantized.linear(x.bfloat16().float()))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_the_dequantized_rows_exactly(kind):
    blocks = _blocks(kind, 40, 256)
    ids = torch.tensor([3, 39, 3, 0])
    quantized = QuantizedWeight(blocks)
    rows = quantized.rows(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, blocks.dequantize()[ids])
    # a forward that samples no row, or embeds no token
    assert quantized.rows(ids[:0]).shape == (0, 256) and quantized.linear(torch.zeros(0, 256)).shape == (0, 40)


def test_any_other_use_fails_loudly():
    quantized = QuantizedWeight(_blocks("Q4_1", 32, 64))
    x = torch.randn(2, 64)
    with pytest.raises(TypeError):
        F.linear(x, quantized)
    with pytest.raises(TypeError):
        quantized * 2
    with pytest.raises(TypeError):
        torch.cat([quantized, quantized])
    with pytest.raises(AttributeError):
        quantized.to(torch.float32)
    with pytest.raises(ValueError, match="quantized weight"):
        quantized.linear(torch.randn(2, 32))


def test_layer_math_multiplies_blocks_unless_asked_to_dequantize():
    blocks = _blocks("Q4_0", 48, 64)
    math, dense_math = CpuLayerMath("float32"), CpuLayerMath("float32", dequantize=True)
    quantized, dense = math.upload(blocks), dense_math.upload(blocks)
    assert isinstance(quantized, QuantizedWeight) and math.upload_lm_head(blocks).shape == (48, 64)
    assert type(dense) is torch.Tensor and torch.equal(dense.view(torch.int32), blocks.dequantize().view(torch.int32))
    plain = torch.randn(4, 4)
    assert torch.equal(math.upload(plain), plain)
    x, ids = torch.randn(3, 64), torch.tensor([7, 1])
    expected = quantized.linear(x)
    assert torch.equal(math.linear(x, quantized), expected)
    assert torch.equal(math.linear_relu(x, quantized), F.relu(expected))
    assert torch.equal(math.logits(x, quantized), expected)
    assert torch.equal(math.embedding(quantized, ids), blocks.dequantize()[ids])
    assert torch.equal(dense_math.linear(x, dense), F.linear(x, blocks.dequantize()))
