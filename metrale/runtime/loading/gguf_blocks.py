"""GGUF weights kept in their quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q8_0): parsed from the file's
block bytes, dequantized when asked, and a stand-in for the dequantized float32 tensor wherever model code treats a
checkpoint tensor as one."""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.deferred_weight import DeferredWeight

BLOCK_SIZE = 32
# kind -> bits of a code. Every kind here has a scale (and a min) per group of 32 columns; the K kinds keep eight
# such groups in a super-block of 256 whose 6-bit scales and mins scale an fp16 d and dmin.
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8}
KINDS = tuple(CODE_BITS)
# kinds whose value gguf computes as d (q - offset): dequantize() keeps that order, which decides the sign of a zero.
OFFSETS = {"Q4_0": 8, "Q5_0": 16}


class BlockWeight(DeferredWeight):
    """A 2-D GGUF weight [rows, columns] kept in groups of 32 along columns.

    kind: one of KINDS. A 4- or 5-bit code q (0..15 or 0..31) stands for scale q + min in its group; a Q8_0 code q
    (-128..127) for scale q.
    codes: 4- and 5-bit kinds uint8 [rows, columns / 2], each code's low 4 bits, 16 bytes a group as Q4_0 stores
      them: byte j of group g holds element 32 g + j in its low nibble and element 32 g + j + 16 in its high nibble.
      Q8_0 int8 [rows, columns].
    high_bits: 5-bit kinds uint8 [rows, columns / 8], each code's fifth bit: bit b of byte k is element 8 k + b's
      (Q5_0's qh, little-endian); None for the others.
    scales: float32 [rows, columns / 32]: d (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; an fp16 in the file) or d sc (the K kinds,
      a float32 product as gguf computes it; exact).
    mins: float32 [rows, columns / 32], or None for Q8_0: Q4_1 and Q5_1's m; -8 d (Q4_0) and -16 d (Q5_0), whose
      values are d (q - 8) and d (q - 16); -(dmin m) for the K kinds. All exact.

    dequantize() gives what gguf.quants.dequantize gives, bit for bit. Any torch function, method or operator on a
    BlockWeight works on that tensor, except torch.cat along dim 0 of BlockWeights of one kind, which stays in blocks
    (a layer's fused q/k/v and gate/up rows)."""

    OWN = ("kind", "codes", "scales", "mins", "high_bits", "shape")

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 high_bits: torch.Tensor | None = None):
        if kind not in KINDS:
            raise InvalidArgument(f"block kind {kind!r} is not one of {KINDS}")
        rows, groups = scales.shape
        code_shape, code_dtype = ((rows, groups * BLOCK_SIZE), torch.int8) if kind == "Q8_0" else \
            ((rows, groups * BLOCK_SIZE // 2), torch.uint8)
        if codes.shape != code_shape or codes.dtype != code_dtype or scales.dtype != torch.float32:
            raise InvalidArgument(f"{kind} blocks: codes {tuple(codes.shape)} {codes.dtype}, scales "
                                  f"{tuple(scales.shape)} {scales.dtype} do not fit together")
        if (mins is None) != (kind == "Q8_0") or (mins is not None and mins.shape != scales.shape):
            raise InvalidArgument(f"{kind} blocks: mins {None if mins is None else tuple(mins.shape)} do not fit")
        high_fits = high_bits.shape == (rows, groups * BLOCK_SIZE // 8) and high_bits.dtype == torch.uint8 \
            if high_bits is not None else CODE_BITS[kind] != 5
        if not high_fits or (high_bits is not None and CODE_BITS[kind] != 5):
            raise InvalidArgument(f"{kind} blocks: high bits "
                                  f"{None if high_bits is None else tuple(high_bits.shape)} do not fit")
        self.kind, self.codes, self.scales, self.mins = kind, codes.contiguous(), scales, mins
        self.high_bits = None if high_bits is None else high_bits.contiguous()
        self.shape = torch.Size((rows, groups * BLOCK_SIZE))

    @property
    def bits(self) -> int:
        """Bits of a code: 4, 5 or 8."""
        return CODE_BITS[self.kind]

    @classmethod
    def from_gguf(cls, kind: str, data: np.ndarray, rows: int, columns: int) -> "BlockWeight":
        """From a GGUF tensor's raw bytes (GGUFReader's uint8 [rows, bytes a row]) of a [rows, columns] weight."""
        if kind not in KINDS:
            raise InvalidArgument(f"GGUF block kind {kind!r} is not one of {KINDS}")
        block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        if columns % block_elements or data.size != rows * columns // block_elements * block_bytes:
            raise InvalidArgument(f"{kind} data of {data.size} bytes is not a [{rows}, {columns}] weight")
        blocks = np.asarray(data, dtype=np.uint8).reshape(rows, columns // block_elements, block_bytes)
        if kind == "Q8_0":
            codes = torch.from_numpy(blocks[..., 2:].reshape(rows, columns).view(np.int8).copy())
            return cls(kind, codes, _fp16(blocks[..., 0:2]), None)
        codes, high_bits, scales, mins = _PARSERS[kind](blocks)
        return cls(kind, torch.from_numpy(codes.reshape(rows, columns // 2).copy()), scales, mins,
                   None if high_bits is None else torch.from_numpy(high_bits.reshape(rows, columns // 8).copy()))

    def __repr__(self) -> str:
        return f"BlockWeight({self.kind}, {list(self.shape)})"

    def unpacked_codes(self) -> torch.Tensor:
        """The codes one an element, in column order: uint8 0..15 or 0..31, Q8_0 int8 -128..127, [rows, columns]."""
        if self.kind == "Q8_0":
            return self.codes
        rows, groups = self.scales.shape
        halves = self.codes.view(rows, groups, 1, BLOCK_SIZE // 2)
        nibbles = torch.cat([halves & 0x0F, halves >> 4], dim=2)             # [rows, groups, 2, 16]
        codes = nibbles.view(self.shape)
        if self.high_bits is None:
            return codes
        shifts = torch.arange(8, dtype=torch.uint8)
        high = (self.high_bits.unsqueeze(-1) >> shifts) & 1                     # [rows, columns / 8, 8]
        return codes | (high.view(self.shape) << 4)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, columns], as gguf.quants.dequantize computes it: d (q - offset), d q (Q8_0) or
        scale q + min (= d q + m, d sc q - dmin m)."""
        codes = self.unpacked_codes().float().view(*self.scales.shape, BLOCK_SIZE)
        scales = self.scales.unsqueeze(-1)
        if self.kind in OFFSETS:
            values = scales * (codes - OFFSETS[self.kind])
        elif self.kind == "Q8_0":
            values = codes * scales
        else:
            values = scales * codes + self.mins.unsqueeze(-1)
        return values.view(self.shape)

    def select_rows(self, ids: torch.Tensor) -> "BlockWeight":
        """The rows ids (int64 [n]), still in blocks."""
        return BlockWeight(self.kind, self.codes[ids], self.scales[ids], None if self.mins is None else self.mins[ids],
                           None if self.high_bits is None else self.high_bits[ids])

    def joins(self, other: DeferredWeight) -> bool:
        return (other.kind, other.shape[1]) == (self.kind, self.shape[1])

    @classmethod
    def joined(cls, weights: list["BlockWeight"]) -> "BlockWeight":
        first = weights[0]
        return cls(first.kind, torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]),
                   None if first.mins is None else torch.cat([w.mins for w in weights]),
                   None if first.high_bits is None else torch.cat([w.high_bits for w in weights]))


def kind_of(tensor_type: GGMLQuantizationType, shape: tuple[int, ...]) -> str | None:
    """The BlockWeight kind a GGUF tensor of this type and (HF-order) shape loads as; None: it is dequantized."""
    return tensor_type.name if tensor_type.name in KINDS and len(shape) == 2 else None


def _fp16(pairs: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 bytes -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32))


# Parsers of a kind's blocks (uint8 [rows, blocks, bytes a block]) -> (codes' low nibbles uint8 [rows, groups, 16],
# fifth bits uint8 [rows, groups, 4] or None, scales and mins float32 [rows, groups]), in BlockWeight's layout.

def _q4_0(blocks: np.ndarray):
    """d, 16 bytes of codes."""
    scales = _fp16(blocks[..., 0:2])
    return blocks[..., 2:], None, scales, -8 * scales


def _q4_1(blocks: np.ndarray):
    """d, m, 16 bytes of codes."""
    return blocks[..., 4:], None, _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])


def _q5_0(blocks: np.ndarray):
    """d, qh (the 32 fifth bits, little-endian), 16 bytes of low nibbles."""
    scales = _fp16(blocks[..., 0:2])
    return blocks[..., 6:], blocks[..., 2:6], scales, -16 * scales


def _q5_1(blocks: np.ndarray):
    """d, m, qh, 16 bytes of low nibbles."""
    return blocks[..., 8:], blocks[..., 4:8], _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])


def _q4_k(blocks: np.ndarray):
    """d, dmin, 12 bytes of 6-bit scales and mins, then 4 chunks of 32 bytes: chunk c holds group 2 c in its low
    nibbles and group 2 c + 1 in its high ones."""
    qs = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 1, 32)
    nibbles = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F      # [rows, blocks, 4, 2, 32]
    return (_packed_nibbles(nibbles), None, *_k_scales_and_mins(blocks))


def _q5_k(blocks: np.ndarray):
    """As Q4_K with 32 bytes of fifth bits before the codes: bit s of byte j is group s's element j's."""
    qh = blocks[..., 16:48].reshape(*blocks.shape[:2], 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1                   # [rows, blocks, 8, 32]
    low, _, scales, mins = _q4_k(np.concatenate([blocks[..., :16], blocks[..., 48:]], axis=-1))
    return low, np.packbits(high, axis=-1, bitorder="little"), scales, mins


def _k_scales_and_mins(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A K kind's scales d sc and mins -(dmin m) float32 [rows, blocks * 8], as gguf's Q4_K.get_scale_min unpacks
    sc and m: bytes 0-3 the low 6 bits of sc 0-3, 4-7 those of m 0-3, 8-11 sc 4-7 and m 4-7 in their low and high
    nibbles, with their top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m)."""
    rows, count = blocks.shape[:2]
    packed = blocks[..., 4:16].reshape(rows, count, 3, 4)
    low_sc, low_m, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 2) & 0x30)], axis=-1)
    m = np.concatenate([low_m & 0x3F, (rest >> 4) | ((low_m >> 2) & 0x30)], axis=-1)
    d, dmin = (np.ascontiguousarray(blocks[..., i:i + 2]).view(np.float16).astype(np.float32) for i in (0, 2))
    scales = d * sc.astype(np.float32)                                              # [rows, blocks, 8]
    mins = -(dmin * m.astype(np.float32))
    return torch.from_numpy(scales.reshape(rows, -1)), torch.from_numpy(mins.reshape(rows, -1))


def _packed_nibbles(codes: np.ndarray) -> np.ndarray:
    """codes 0..15 uint8 [rows, ..., 32 a group] -> [rows, groups, 16]: byte j is element j | element j + 16 << 4."""
    groups = codes.reshape(codes.shape[0], -1, 2, BLOCK_SIZE // 2)
    return groups[..., 0, :] | (groups[..., 1, :] << 4)


_PARSERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k}
