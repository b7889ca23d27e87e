"""One forward's flattened inputs: the new tokens of every sequence in the step, with where their KV goes."""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from metrale.runtime.cache.blocks import blocks_for
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
    # Models with recurrent layers: each segment's (source, destination) state slots; the forward reads the state
    # from the source (-1: zeros) and writes the advanced state into the destination (cache/specs.RecurrentState).
    state_slots: list[tuple[int, int]] | None = None
    # What a runner built from this batch ahead of running it (Runner.stage), its own to read.
    staged: object = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def samples_every_row(self) -> bool:
        """Whether every row becomes logits, in order (a decode step's batch; sample_rows only ever ascend)."""
        return len(self.sample_rows) == self.num_tokens


@dataclass(slots=True)
class Segment:
    """One sequence's part of a forward: new tokens appended after `start` cached ones."""
    block_table: BlockTable
    start: int
    tokens: tuple[int, ...] | list[int]
    samples: bool
    # Encoder-decoder models: the blocks holding the segment's source's cross-attention K/V, and its length.
    cross: tuple[BlockTable, int] | None = None
    # Models with recurrent layers: the (source, destination) state slots (ForwardBatch.state_slots).
    state: tuple[int, int] | None = None


def build_batch(segments: list[Segment], kv_block_size: int) -> ForwardBatch:
    lens = [len(seg.tokens) for seg in segments]
    one_token = lens.count(1) == len(lens)
    batch = _one_token_batch(segments, kv_block_size) if one_token else _token_batch(segments, lens, kv_block_size)
    if any(seg.cross is not None for seg in segments):
        batch.cross = _cross_batch(batch, [seg.cross for seg in segments], kv_block_size)
    if any(seg.state is not None for seg in segments):
        batch.state_slots = [seg.state for seg in segments]
    return batch


def _one_token_batch(segments: list[Segment], kv_block_size: int) -> ForwardBatch:
    """Segments of one token each (decode tokens: the common case, kept cheap where there are few)."""
    token_ids, positions, slots, contexts, tables, sample_rows = [], [], [], [], [], []
    for row, seg in enumerate(segments):
        start, table = seg.start, seg.block_table
        token_ids.append(seg.tokens[0])
        positions.append(start)
        slots.append(table.slot(start, kv_block_size))
        contexts.append(start + 1)
        tables.append(table.array(blocks_for(start + 1, kv_block_size)))
        if seg.samples:
            sample_rows.append(row)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    rows = list(range(len(segments)))
    return ForwardBatch(as_long(token_ids), as_long(positions), as_long(slots), rows, [1] * len(rows), contexts,
                        tables, as_long(sample_rows))


def _token_batch(segments: list[Segment], lens: list[int], kv_block_size: int) -> ForwardBatch:
    """Any segments, their rows' positions and slots computed for all at once."""
    total = sum(lens)
    firsts = [seg.start for seg in segments]
    contexts = [a + n for a, n in zip(firsts, lens)]
    # Each segment's blocks up to its last new token (IndexError where its table is shorter).
    tables = [seg.block_table.array(blocks_for(c, kv_block_size)) for seg, c in zip(segments, contexts)]
    token_ids = np.fromiter(itertools.chain.from_iterable(seg.tokens for seg in segments), dtype=np.int64,
                            count=total)
    starts = np.zeros(len(segments), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    # A token's position: its segment's start plus its row's offset in the segment.
    positions = np.arange(total, dtype=np.int64) + np.repeat(np.asarray(firsts, dtype=np.int64) - starts, lens)
    # Its slot: the block holding that position (in the segment's table, all tables back to back), and the offset.
    table_starts = np.zeros(len(segments), dtype=np.int64)
    np.cumsum([len(t) for t in tables[:-1]], out=table_starts[1:])
    blocks = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int32)
    index, offset = np.divmod(positions, kv_block_size)
    slots = blocks[np.repeat(table_starts, lens) + index].astype(np.int64) * kv_block_size + offset
    query_starts = starts.tolist()
    sample_rows = [row + n - 1 for seg, row, n in zip(segments, query_starts, lens) if seg.samples]
    return ForwardBatch(torch.from_numpy(token_ids), torch.from_numpy(positions), torch.from_numpy(slots),
                        query_starts, lens, contexts, tables, torch.tensor(sample_rows, dtype=torch.int64))


def build_decode_batch(tokens: list[int], positions: list[int], tables: list[list[int]], kv_block_size: int,
                       crosses: list[tuple[BlockTable, int]] | None = None,
                       states: list[tuple[int, int]] | None = None) -> ForwardBatch:
    """build_batch for segments of one new token each, all sampled (a beam search step), from plain lists: each
    segment's token, its position and the block ids covering it; crosses as Segment.cross and states as
    Segment.state, per segment."""
    arrays = [np.asarray(t, dtype=np.int32) for t in tables]
    index, offset = np.divmod(np.asarray(positions, dtype=np.int64), kv_block_size)
    slots = np.fromiter((a[i] for a, i in zip(arrays, index.tolist())), dtype=np.int64, count=len(arrays))
    rows = torch.arange(len(tokens))
    batch = ForwardBatch(torch.tensor(tokens, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                         torch.from_numpy(slots * kv_block_size + offset), rows.tolist(), [1] * len(tokens),
                         [p + 1 for p in positions], arrays, rows)
    if crosses is not None:
        batch.cross = _cross_batch(batch, crosses, kv_block_size)
    batch.state_slots = states
    return batch


def _cross_batch(batch: ForwardBatch, crosses: list[tuple[BlockTable, int]], kv_block_size: int) -> ForwardBatch:
    """The batch's rows as queries over their sources' cross-attention blocks: every source key, no KV written."""
    lengths = [n for _, n in crosses]
    tables = [table.array(blocks_for(n, kv_block_size)) for table, n in crosses]
    return ForwardBatch(batch.token_ids, batch.positions, torch.full_like(batch.slot_mapping, -1), batch.query_starts,
                        batch.query_lens, lengths, tables, batch.sample_rows[:0])
