"""Which part of each checkpoint tensor a rank holds, as Megatron-LM splits a decoder: a linear that fans out
(query/key/value heads, the MLP's gate and up) by its output rows, "columns" of the layer (each rank computes its
heads' or its MLP slice's outputs in full); the linear after it (attention output, MLP down) by its input columns,
"rows" (each rank's product is a partial sum that the layer math sums over the ranks, its bias added once: rank 0
holds it, the others zeros); a value for each KV head (an FP8 KV cache's scales) by heads, as the key and value
projections' rows go, where it is not one value for all; everything else (norms, the embedding, a mixture's router)
whole on every rank. A mixture's experts split as its dense MLP does, each expert's width over the ranks: experts
stacked [experts, rows, columns] (transformers 5) split their last two dimensions as a linear's two. A tensor whose
rows are several linears' or parts' one after another (a stacked gate-and-up projection; a Mamba2 mixer's in_proj:
its gate, x, B, C and dt; its conv's x, B and C channels) splits each segment (Segments). A family says which tensor
is which by name suffix, and divides its config's head and width counts by the size."""

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.fp8 import TensorsAsRead
from metrale.runtime.parallel.group import Shard

COLUMNS = "columns"
ROWS = "rows"
HEADS = "heads"


@dataclass(frozen=True)
class Segments:
    """Rows along `dim` that are segments of the given sizes one after another, each split over the ranks: a rank
    holds its part of every segment, in their order. pieces: each segment's number of parts (None: one a rank); a
    segment of fewer parts than ranks (a divisor of their number) is shared by the ranks in turn, rank r holding part
    r * pieces // size (a Mamba2 mixer's B and C groups, fewer than the ranks: each rank's heads read one group)."""
    sizes: tuple[int, ...]
    dim: int = 0
    pieces: tuple[int, ...] | None = None

    def parts(self, shard: Shard, name: str) -> list[tuple[int, int, int]]:
        """(segment size, first row, rows) of the rank's part of each segment."""
        out = []
        for i, size in enumerate(self.sizes):
            pieces = shard.size if self.pieces is None else self.pieces[i]
            piece = Shard(shard.rank * pieces // shard.size, pieces).part(size, f"{name}'s segment of {size}")
            out.append((size, piece.start, piece.stop - piece.start))
        return out


def kv_heads(count: int, head_dim: int, shard: Shard) -> tuple[int, "str | Segments"]:
    """A rank's KV heads and the split of the key and value projections' rows (and biases): by heads where the ranks
    divide them; where they are fewer than the ranks (a divisor of their number), each rank holds the one KV head its
    query heads read, the ranks of one head alike (as Megatron-LM replicates grouped-query attention's KV heads)."""
    heads = head_share(count, shard, "num_key_value_heads")
    if count % shard.size == 0:
        return heads.stop - heads.start, COLUMNS
    return 1, Segments((count * head_dim,), pieces=(count,))


def head_share(count: int, shard: Shard, what: str) -> slice:
    """The rank's KV heads of `count`: its part, or the one its query heads read where they are fewer than the
    ranks (a divisor of their number)."""
    if count < shard.size and shard.size % count == 0:
        head = shard.rank * count // shard.size
        return slice(head, head + 1)
    return shard.part(count, what)


def attention(num_heads: int, num_kv_heads: int, head_dim: int, shard: Shard) -> tuple[int, int, dict]:
    """A rank's query and KV heads, and the splits of an attention's q, k, v and o projections (and biases): q by
    heads, k and v by KV heads (kv_heads), o by input columns."""
    local_kv_heads, kv = kv_heads(num_kv_heads, head_dim, shard)
    splits = {"q_proj.weight": COLUMNS, "q_proj.bias": COLUMNS, "o_proj.weight": ROWS, "o_proj.bias": ROWS,
              **{f"{p}_proj.{t}": kv for p in "kv" for t in ("weight", "bias")}}
    return shard.divided(num_heads, "num_attention_heads"), local_kv_heads, splits


class ShardedTensors(TensorsAsRead):
    """name -> this rank's part of the checkpoint tensor: splits maps name suffixes to COLUMNS, ROWS, HEADS or a
    Segments (any other tensor is whole)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], splits: Mapping[str, "str | Segments"], shard: Shard):
        self.splits, self.shard = splits, shard
        super().__init__(tensors)

    def split_of(self, name: str) -> "str | Segments | None":
        return next((kind for suffix, kind in self.splits.items() if name.endswith(suffix)), None)

    def read(self, name: str, tensor: torch.Tensor):
        kind = self.split_of(name)
        if kind is None or (kind == HEADS and tensor.numel() == 1):
            return tensor
        if kind == HEADS:           # a value a KV head, however the checkpoint shapes it ([heads], [heads, 1, 1])
            return tensor.flatten()[head_share(tensor.numel(), self.shard, f"{name}'s heads")].contiguous()
        if type(tensor) is not torch.Tensor:
            raise InvalidArgument(f"tensor parallel splits plain tensors, not {name}'s {type(tensor).__name__} "
                                  f"(quantized checkpoints run on one device)")
        if kind == ROWS and tensor.dim() == 1:      # a row-split linear's bias: added once, by rank 0
            return tensor if self.shard.rank == 0 else torch.zeros_like(tensor)
        if kind == ROWS:
            return tensor[..., self.shard.part(tensor.shape[-1], f"{name}'s columns")].contiguous()
        if isinstance(kind, Segments):
            if sum(kind.sizes) != tensor.shape[kind.dim]:
                raise InvalidArgument(f"{name} has {tensor.shape[kind.dim]} rows along dimension {kind.dim}, not its "
                                      f"config's {' + '.join(map(str, kind.sizes))}")
            segments = tensor.split(kind.sizes, dim=kind.dim)
            return torch.cat([segment.narrow(kind.dim, start, rows)
                              for segment, (_, start, rows) in zip(segments, kind.parts(self.shard, name))],
                             dim=kind.dim)
        rows = max(tensor.dim() - 2, 0)         # the output rows' dimension: a linear's, or stacked experts'
        return tensor[(slice(None),) * rows + (self.shard.part(tensor.shape[rows], f"{name}'s rows"),)].contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        shape, kind = super().shape(name), self.split_of(name)
        if kind == HEADS:
            numel = math.prod(shape)
            heads = head_share(numel, self.shard, f"{name}'s heads")
            return shape if numel == 1 else (heads.stop - heads.start,)
        if isinstance(kind, Segments):
            rows = sum(part[2] for part in kind.parts(self.shard, name))
            return (*shape[:kind.dim], rows, *shape[kind.dim + 1:])
        if kind == COLUMNS:
            rows = max(len(shape) - 2, 0)
            return (*shape[:rows], shape[rows] // self.shard.size, *shape[rows + 1:])
        if kind == ROWS and len(shape) >= 2:
            return (*shape[:-1], shape[-1] // self.shard.size)
        return shape
