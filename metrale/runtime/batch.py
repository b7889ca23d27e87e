"""One forward's flattened inputs: the new tokens of every sequence in the step, with where their KV goes."""

from dataclasses import dataclass

import numpy as np
import torch

from metrale.runtime.kv_blocks import blocks_for
from metrale.runtime.sequence import BlockTable


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor      # [T] int64, the new tokens of all segments back to back
    positions: torch.Tensor      # [T] int64, each token's position in its sequence
    slot_mapping: torch.Tensor   # [T] int64, block * kv_block_size + offset of each token's K/V
    query_starts: list[int]      # [S] first row of each segment in T
    query_lens: list[int]        # [S] new tokens of each segment
    context_lens: list[int]      # [S] tokens each segment attends to, new ones included
    block_tables: list  # [S] int32 arrays (or lists) of the block ids covering context_lens
    sample_rows: torch.Tensor    # [N] int64 rows of T whose hidden states become logits
    # Encoder-decoder models: the same rows over their sources' cross-attention K/V blocks (build_batch sets it;
    # the model attends over it without the causal limit).
    cross: "ForwardBatch | None" = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(slots=True)
class Segment:
    """One sequence's part of a forward: new tokens appended after `start` cached ones."""
    block_table: BlockTable
    start: int
    tokens: tuple[int, ...] | list[int]
    samples: bool
    # Encoder-decoder models: the blocks holding the segment's source's cross-attention K/V, and its length.
    cross: tuple[BlockTable, int] | None = None


def build_batch(segments: list[Segment], kv_block_size: int) -> ForwardBatch:
    token_ids, positions, slots, starts, lens, contexts, tables, sample_rows = [], [], [], [], [], [], [], []
    for seg in segments:
        row = len(token_ids)
        n = len(seg.tokens)
        start, table = seg.start, seg.block_table
        token_ids.extend(seg.tokens)
        if n == 1:   # a decode lane: the common case, kept cheap
            positions.append(start)
            slots.append(table.slot(start, kv_block_size))
        else:
            span = np.arange(start, start + n)
            positions.extend(range(start, start + n))
            slots.extend((table.array()[span // kv_block_size] * kv_block_size + span % kv_block_size).tolist())
        starts.append(row)
        lens.append(n)
        contexts.append(start + n)
        tables.append(table.array(blocks_for(start + n, kv_block_size)))
        if seg.samples:
            sample_rows.append(row + n - 1)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(as_long(token_ids), as_long(positions), as_long(slots), starts, lens, contexts, tables,
                         as_long(sample_rows))
    if any(seg.cross is not None for seg in segments):
        batch.cross = _cross_batch(batch, [seg.cross for seg in segments], kv_block_size)
    return batch


def build_decode_batch(tokens: list[int], positions: list[int], tables: list[list[int]], kv_block_size: int,
                       crosses: list[tuple[BlockTable, int]] | None = None) -> ForwardBatch:
    """build_batch for segments of one new token each, all sampled (a beam search step), from plain lists: each
    segment's token, its position and the block ids covering it; crosses as Segment.cross, per segment."""
    arrays = [np.asarray(t, dtype=np.int32) for t in tables]
    index, offset = np.divmod(np.asarray(positions, dtype=np.int64), kv_block_size)
    slots = np.fromiter((a[i] for a, i in zip(arrays, index.tolist())), dtype=np.int64, count=len(arrays))
    rows = torch.arange(len(tokens))
    batch = ForwardBatch(torch.tensor(tokens, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                         torch.from_numpy(slots * kv_block_size + offset), rows.tolist(), [1] * len(tokens),
                         [p + 1 for p in positions], arrays, rows)
    if crosses is not None:
        batch.cross = _cross_batch(batch, crosses, kv_block_size)
    return batch


def _cross_batch(batch: ForwardBatch, crosses: list[tuple[BlockTable, int]], kv_block_size: int) -> ForwardBatch:
    """The batch's rows as queries over their sources' cross-attention blocks: every source key, no KV written."""
    lengths = [n for _, n in crosses]
    tables = [table.array(blocks_for(n, kv_block_size)) for table, n in crosses]
    return ForwardBatch(batch.token_ids, batch.positions, torch.full_like(batch.slot_mapping, -1), batch.query_starts,
                        batch.query_lens, lengths, tables, batch.sample_rows[:0])
