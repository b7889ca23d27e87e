"""One forward's flattened inputs: the new tokens of every sequence in the step, with where their KV goes."""

from dataclasses import dataclass

import torch

from metrale.runtime.kv_blocks import blocks_for


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor      # [T] int64, the new tokens of all segments back to back
    positions: torch.Tensor      # [T] int64, each token's position in its sequence
    slot_mapping: torch.Tensor   # [T] int64, block * kv_block_size + offset of each token's K/V
    query_starts: list[int]      # [S] first row of each segment in T
    query_lens: list[int]        # [S] new tokens of each segment
    context_lens: list[int]      # [S] tokens each segment attends to, new ones included
    block_tables: list[list[int]]  # [S] block ids covering context_lens
    sample_rows: torch.Tensor    # [N] int64 rows of T whose hidden states become logits

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class Segment:
    """One sequence's part of a forward: new tokens appended after `start` cached ones."""
    block_table: list[int]
    start: int
    tokens: list[int]
    samples: bool


def build_batch(segments: list[Segment], kv_block_size: int) -> ForwardBatch:
    token_ids, positions, slots, starts, lens, contexts, tables, sample_rows = [], [], [], [], [], [], [], []
    for seg in segments:
        row = len(token_ids)
        n = len(seg.tokens)
        span = range(seg.start, seg.start + n)
        token_ids.extend(seg.tokens)
        positions.extend(span)
        if n == 1:
            slots.append(seg.block_table[seg.start // kv_block_size] * kv_block_size + seg.start % kv_block_size)
        else:
            slots.extend(seg.block_table[p // kv_block_size] * kv_block_size + p % kv_block_size for p in span)
        starts.append(row)
        lens.append(n)
        contexts.append(seg.start + n)
        tables.append(seg.block_table[:blocks_for(seg.start + n, kv_block_size)])
        if seg.samples:
            sample_rows.append(row + n - 1)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(as_long(token_ids), as_long(positions), as_long(slots), starts, lens, contexts, tables,
                        as_long(sample_rows))
