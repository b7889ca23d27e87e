"""The LM head on the CUDA backend, whole on one device or split by vocabulary over tensor-parallel ranks: the rows a
rank holds (padded as the logits GEMM wants them), and its logits gathered into whole rows on rank 0, which samples
them (the other ranks' logits are never read)."""

import torch

from metrale.runtime.backend.cuda.linears import linear_into
from metrale.runtime.backend.cuda.stream_context import StreamContext, padded_vocab, vocab_part
from metrale.runtime.backend.cuda.tensor import DeviceTensor


def head_rows(table: torch.Tensor, shard) -> torch.Tensor:
    """The LM head's rows a rank holds, zero rows after the vocabulary: all of them padded to padded_vocab on one
    device (shard None), its vocab_part of them otherwise."""
    if shard is None:
        rows, part = padded_vocab(table.shape[0]), table
    else:
        rows = vocab_part(table.shape[0], shard.size)
        part = table[shard.rank * rows:(shard.rank + 1) * rows]
    return torch.nn.functional.pad(part, (0, 0, 0, rows - part.shape[0]))


def gathered_logits(resources, ctx: StreamContext, x: DeviceTensor, lm_head: DeviceTensor) -> DeviceTensor:
    """The rank's part of every row's logits, into its place among the ranks' parts (rank after rank, each [rows,
    part]); NCCL gathers the others'; rank 0 lays them side by side in its logits rows. The vocabulary's columns."""
    rows, part, shard = x.shape[0], lm_head.shape[0], resources.shard
    parts = ctx.logits_parts

    def of_rank(r: int) -> DeviceTensor:
        return DeviceTensor(parts.ptr + r * rows * part * parts.itemsize, (rows, part), parts.dtype)
    linear_into(resources.lib, resources.gemm, ctx, of_rank(shard.rank), x, lm_head)
    resources.collectives.all_gather(parts, rows * part, ctx.stream)
    out = ctx.logits.rows(0, rows)
    if shard.rank == 0:
        for r in range(shard.size):
            resources.cuda.copy_columns(out.columns(r * part, (r + 1) * part), of_rank(r), ctx.stream)
    return out.columns(0, resources.shapes.vocab)
