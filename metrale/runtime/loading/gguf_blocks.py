"""GGUF weights kept in their quantized blocks (Q4_0, Q4_1, Q8_0): parsed from the file's block bytes, dequantized
when asked, and a stand-in for the dequantized float32 tensor wherever model code treats a checkpoint tensor as one."""

import numpy as np
import torch
from gguf import GGMLQuantizationType

from metrale.runtime.errors import InvalidArgument

BLOCK_SIZE = 32
# kind -> bytes of one block of 32: an fp16 scale d (and Q4_1's fp16 min m), then the codes.
BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 4 + 16, "Q8_0": 2 + 32}
KINDS = tuple(BLOCK_BYTES)


class BlockWeight:
    """A 2-D GGUF weight [rows, columns] kept in its blocks of 32 along columns.

    kind: "Q4_0", "Q4_1" or "Q8_0".
    codes: Q4_0 / Q4_1 uint8 [rows, columns / 2], the file's 16 bytes a block as they are: byte j of block b holds
      element 32 b + j in its low nibble and element 32 b + j + 16 in its high nibble. Q8_0 int8 [rows, columns].
    scales: float32 [rows, columns / 32], each block's d (an fp16 in the file, so exact).
    mins: float32 [rows, columns / 32], or None for Q8_0. A 4-bit code q stands for d q + min: Q4_1's min is its m;
      Q4_0's value d (q - 8) makes its min -8 d (exact). A Q8_0 code q (-128..127) stands for d q.

    dequantize() gives what gguf.quants.dequantize gives, bit for bit. Any torch function, method or operator on a
    BlockWeight works on that tensor, except torch.cat along dim 0 of BlockWeights of one kind, which stays in blocks
    (a layer's fused q/k/v and gate/up rows)."""

    dtype = torch.float32

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None):
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
        self.kind, self.codes, self.scales, self.mins = kind, codes.contiguous(), scales, mins
        self.shape = torch.Size((rows, groups * BLOCK_SIZE))

    @classmethod
    def from_gguf(cls, kind: str, data: np.ndarray, rows: int, columns: int) -> "BlockWeight":
        """From a GGUF tensor's raw bytes (GGUFReader's uint8 [rows, bytes a row]) of a [rows, columns] weight."""
        if kind not in KINDS:
            raise InvalidArgument(f"GGUF block kind {kind!r} is not one of {KINDS}")
        if columns % BLOCK_SIZE or data.size != rows * columns // BLOCK_SIZE * BLOCK_BYTES[kind]:
            raise InvalidArgument(f"{kind} data of {data.size} bytes is not a [{rows}, {columns}] weight")
        blocks = np.asarray(data, dtype=np.uint8).reshape(rows, columns // BLOCK_SIZE, BLOCK_BYTES[kind])
        scales = _fp16(blocks[..., 0:2])
        if kind == "Q8_0":
            codes = torch.from_numpy(blocks[..., 2:].reshape(rows, columns).view(np.int8).copy())
            return cls(kind, codes, scales, None)
        codes = torch.from_numpy(blocks[..., -16:].reshape(rows, columns // 2).copy())
        mins = _fp16(blocks[..., 2:4]) if kind == "Q4_1" else -8 * scales
        return cls(kind, codes, scales, mins)

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"BlockWeight({self.kind}, {list(self.shape)})"

    def unpacked_codes(self) -> torch.Tensor:
        """The codes one an element, in column order: Q4 uint8 0..15, Q8_0 int8 -128..127, [rows, columns]."""
        if self.kind == "Q8_0":
            return self.codes
        rows, groups = self.scales.shape
        halves = self.codes.view(rows, groups, 1, BLOCK_SIZE // 2)
        nibbles = torch.cat([halves & 0x0F, halves >> 4], dim=2)             # [rows, blocks, 2, 16]
        return nibbles.view(self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, columns], as gguf.quants.dequantize computes it (d (q - 8), d q + m, d q)."""
        codes = self.unpacked_codes().float().view(*self.scales.shape, BLOCK_SIZE)
        scales = self.scales.unsqueeze(-1)
        if self.kind == "Q4_0":
            values = scales * (codes - 8)
        elif self.kind == "Q4_1":
            values = scales * codes + self.mins.unsqueeze(-1)
        else:
            values = codes * scales
        return values.view(self.shape)

    def select_rows(self, ids: torch.Tensor) -> "BlockWeight":
        """The rows ids (int64 [n]), still in blocks."""
        return BlockWeight(self.kind, self.codes[ids], self.scales[ids], None if self.mins is None else self.mins[ids])

    @classmethod
    def concatenated(cls, weights: list["BlockWeight"]) -> "BlockWeight":
        """The rows of weights of one kind and width, in order."""
        first = weights[0]
        return cls(first.kind, torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]),
                   None if first.mins is None else torch.cat([w.mins for w in weights]))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat and _cat_of_blocks(*args, **kwargs):
            return cls.concatenated(list(args[0] if args else kwargs["tensors"]))
        return func(*_dequantized(args), **_dequantized(kwargs))

    def __getattr__(self, name: str):
        # Tensor methods and attributes (.float(), .to(), .contiguous(), .T) on the dequantized tensor.
        if name.startswith("__") or name in ("kind", "codes", "scales", "mins", "shape"):
            raise AttributeError(name)
        return getattr(self.dequantize(), name)

    def __getitem__(self, index):
        return self.dequantize()[index]

    def __neg__(self):
        return -self.dequantize()

    def __add__(self, other):
        return self.dequantize() + _dequantized(other)

    def __radd__(self, other):
        return _dequantized(other) + self.dequantize()

    def __sub__(self, other):
        return self.dequantize() - _dequantized(other)

    def __rsub__(self, other):
        return _dequantized(other) - self.dequantize()

    def __mul__(self, other):
        return self.dequantize() * _dequantized(other)

    def __rmul__(self, other):
        return _dequantized(other) * self.dequantize()

    def __truediv__(self, other):
        return self.dequantize() / _dequantized(other)

    def __matmul__(self, other):
        return self.dequantize() @ _dequantized(other)

    def __rmatmul__(self, other):
        return _dequantized(other) @ self.dequantize()


def kind_of(tensor_type: GGMLQuantizationType, shape: tuple[int, ...]) -> str | None:
    """The BlockWeight kind a GGUF tensor of this type and (HF-order) shape loads as; None: it is dequantized."""
    return tensor_type.name if tensor_type.name in KINDS and len(shape) == 2 else None


def _fp16(pairs: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 bytes -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32))


def _cat_of_blocks(tensors, dim: int = 0, **out) -> bool:
    """Whether torch.cat(tensors, dim) stacks the rows of BlockWeights of one kind and width."""
    kinds = {(w.kind, w.shape[1]) if isinstance(w, BlockWeight) else None for w in tensors}
    return dim in (0, -2) and not out and len(kinds) == 1 and None not in kinds


def _dequantized(value):
    """value with every BlockWeight in it (in lists, tuples and dicts too) dequantized."""
    if isinstance(value, BlockWeight):
        return value.dequantize()
    if type(value) in (list, tuple):
        return type(value)(_dequantized(item) for item in value)
    if isinstance(value, dict):
        return {key: _dequantized(item) for key, item in value.items()}
    return value
