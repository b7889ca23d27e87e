"""GGUF block weights as the CPU backend multiplies them: 4-bit codes packed for torch's int4 matrix kernel
(aten._weight_int4pack_mm_for_cpu, bf16 activations, a bf16 scale and zero per group of 32), and exact float32 rows
for an embedding."""

import torch
import torch.nn.functional as F

from metrale.runtime.loading.gguf_blocks import BLOCK_SIZE, BlockWeight

# _convert_weight_to_int4pack_for_cpu takes output rows in multiples of 16; packing converts this many rows at a
# time (a multiple of the kernel's 64-row tiles), so the int32 codes it needs stay small.
ROW_MULTIPLE = 16
PACK_ROWS = 4096


class QuantizedWeight:
    """A BlockWeight [rows, columns] packed for aten._weight_int4pack_mm_for_cpu, which dequantizes a 4-bit code c
    as (c - 8) scale + zero, in float32 from a bf16 scale and zero per group of 32, and accumulates in float32.

    A 4-bit code (Q4_0, Q4_1, Q4_K: scale q + min) is packed as it is: zero = min + 8 scale. A 5-bit code
    (Q5_0, Q5_1, Q5_K) q = 16 h + l splits into two 4-bit codes, scale q + min = 16 scale (h - 8) + 128 scale
    + scale (l - 8) + min + 8 scale, so the packed weight is [rows, 2 columns], the h codes (scale 16 scale, zero
    128 scale) then the l codes (scale, zero min + 8 scale), and linear() doubles x along columns. Q8_0 (d q,
    q in -128..127) likewise: the byte q + 128 = 16 h + l, d q = 16 d (h - 8) + d (l - 8) + 8 d, the h codes
    (scale 16 d, zero 8 d) then the l codes (scale d, zero 0).

    What the bf16 rounding costs (u = 2^-9, bf16's unit roundoff): the h halves' scales and zeros are the scale
    times powers of two, so they add 16 h bf16(scale) exactly, and an element is off the float32 dequantized weight
    by at most u (|q - 8| |scale| + |min + 8 scale|) (4 and 5 bits). That is u |w| for Q4_0, Q5_0 and Q8_0 (their
    zeros are 0 or d times powers of two, so the weight is exactly (q - offset) bf16(d)), and for Q4_1, Q5_1 and
    the K kinds a few u of the group's range; x is rounded to bf16 (u |x|), and the product to bf16
    (u |y|): what a linear costs run in bfloat16."""

    def __init__(self, blocks: BlockWeight):
        self.blocks, self.shape = blocks, blocks.shape
        self.doubled = blocks.bits > 4
        codes, scales, zeros = _int4_groups(blocks)                         # [rows, K], [rows, K / 32] x 2
        if padding := -blocks.shape[0] % ROW_MULTIPLE:
            codes, scales, zeros = (F.pad(t, (0, 0, 0, padding)) for t in (codes, scales, zeros))
        self.packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk.int(), 1)
                                 for chunk in codes.split(PACK_ROWS)])    # uint8 [padded rows, K / 2]
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)     # [K / 32, padded rows, 2]
        self.scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes a linear() reads of the weight."""
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, columns] @ weight^T (+ bias) -> [T, rows] in x's dtype; the product in bf16."""
        if x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"linear of x {tuple(x.shape)} with a quantized weight {tuple(self.shape)}")
        x16 = x.to(torch.bfloat16)
        if self.doubled:
            x16 = torch.cat([x16, x16], dim=1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x16.contiguous(), self.packed, BLOCK_SIZE,
                                                         self.scales_and_zeros)
        if self.packed.shape[0] != self.shape[0]:
            out = out[:, :self.shape[0]]
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), columns]: the dequantized weight's rows ids, exactly (an embedding)."""
        return self.blocks.select_rows(ids).dequantize()

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.blocks.kind}, {list(self.shape)})"


def _int4_groups(blocks: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 uint8 [rows, K], scales, zeros float32 [rows, K / 32]) with weight = (code - 8) scale + zero in
    each group of 32 columns: K = columns for 4-bit codes, 2 columns for 5- and 8-bit ones (the high nibbles'
    groups, then the low)."""
    codes, scales = blocks.unpacked_codes(), blocks.scales
    if blocks.bits == 4:
        return codes, scales, blocks.mins + 8 * scales
    if blocks.bits == 5:                                                    # 16 h + l
        high_zeros, low_zeros = 128 * scales, blocks.mins + 8 * scales
    else:
        codes = (codes.to(torch.int16) + 128).to(torch.uint8)              # 16 h + l
        high_zeros, low_zeros = 8 * scales, torch.zeros_like(scales)
    return (torch.cat([codes >> 4, codes & 0x0F], dim=1), torch.cat([16 * scales, scales], dim=1),
            torch.cat([high_zeros, low_zeros], dim=1))
