"""A forward's flat inputs on the host: the block tables sequences keep, build_batch, and the CUDA backend's packing
of a batch into its metadata region (pure numpy: no GPU needed)."""

import numpy as np
import pytest
import torch

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.sequence import BlockTable

BLOCK = 4


def test_block_table_grows_truncates_and_maps_slots():
    table = BlockTable([7, 3])
    table.extend(list(range(100, 130)))          # past the initial capacity of 16
    assert len(table) == 32 and table.tolist() == [7, 3] + list(range(100, 130))
    assert table.slot(0, BLOCK) == 28 and table.slot(5, BLOCK) == 13 and table.slot(9, BLOCK) == 401
    assert table.array(3).tolist() == [7, 3, 100]
    assert table.truncate(2) == list(range(100, 130)) and table.tolist() == [7, 3]
    table.extend([9])
    assert table.tolist() == [7, 3, 9] and table.truncate(5) == [] and len(table) == 3
    table.truncate(1)
    with pytest.raises(IndexError):
        table.slot(4, BLOCK)           # block 1 was freed: its old id stays in the buffer, never handed out
    with pytest.raises(IndexError):
        table.array(2)


def mixed_segments():
    # a decode token at position 9, a prompt chunk of 6 tokens after 2 cached ones (not sampled), a new prompt of 3
    return [Segment(BlockTable([5, 8, 2]), 9, (11,), True),
            Segment(BlockTable([1, 6]), 2, (20, 21, 22, 23, 24, 25), False),
            Segment(BlockTable([4]), 0, (30, 31, 32), True)]


def test_build_batch_flattens_segments():
    batch = build_batch(mixed_segments(), BLOCK)
    assert batch.token_ids.tolist() == [11, 20, 21, 22, 23, 24, 25, 30, 31, 32]
    assert batch.positions.tolist() == [9, 2, 3, 4, 5, 6, 7, 0, 1, 2]
    # slot = block_table[p // 4] * 4 + p % 4
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 6 * 4, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3,
                                           4 * 4, 4 * 4 + 1, 4 * 4 + 2]
    assert batch.query_starts == [0, 1, 7] and batch.query_lens == [1, 6, 3] and batch.context_lens == [10, 8, 3]
    assert [list(t) for t in batch.block_tables] == [[5, 8, 2], [1, 6], [4]]
    assert batch.sample_rows.tolist() == [0, 9]
    assert all(t.dtype == torch.int64 for t in (batch.token_ids, batch.positions, batch.slot_mapping))


def test_pack_batch_lays_out_decode_and_prefill():
    cuda_batch = pytest.importorskip("metrale.runtime.backend.cuda.batch")
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    region = DeviceTensor(1 << 32, (4096,), "int32")
    packed = cuda_batch.pack_batch(build_batch(mixed_segments(), BLOCK), region, max_blocks=5, query_rows=True)

    def read(view):
        offset = (view.ptr - region.ptr) // 4
        return packed.host[offset:offset + view.numel].reshape(view.shape).tolist()
    assert read(packed.token_ids) == [11, 20, 21, 22, 23, 24, 25, 30, 31, 32]
    assert read(packed.decode_rows) == [0] and read(packed.decode_contexts) == [10]
    assert read(packed.decode_tables) == [[5, 8, 2, 0, 0]]
    assert read(packed.prefill_starts) == [1, 7] and read(packed.prefill_lens) == [6, 3]
    assert read(packed.prefill_contexts) == [8, 3] and read(packed.prefill_tables) == [[1, 6, 0, 0, 0], [4, 0, 0, 0, 0]]
    assert read(packed.sample_rows) == [0, 9]
    # each row over its causal context, by its block table's row in decode_tables then prefill_tables
    assert read(packed.row_contexts) == [10, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    assert read(packed.row_tables) == [0, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert read(packed.tables)[1:] == [[1, 6, 0, 0, 0], [4, 0, 0, 0, 0]] and read(packed.tables)[0] == [5, 8, 2, 0, 0]
    assert (packed.num_tokens, packed.num_decode, packed.num_prefill) == (10, 1, 2)
    assert packed.max_decode_context == 10 and packed.max_prefill_query == 6


def test_pack_batch_pads_a_decode_batch_to_its_graph():
    cuda_batch = pytest.importorskip("metrale.runtime.backend.cuda.batch")
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    region = DeviceTensor(1 << 32, (4096,), "int32")
    rows = [Segment(BlockTable([3, 9]), 6, (40,), True), Segment(BlockTable([7]), 2, (41,), True)]
    packed = cuda_batch.pack_batch(build_batch(rows, BLOCK), region, max_blocks=3, pad_to=4, query_rows=True)

    def read(view):
        offset = (view.ptr - region.ptr) // 4
        return packed.host[offset:offset + view.numel].reshape(view.shape).tolist()
    # padding rows: token 0 at position 0, KV slot -1 (written nowhere), context 0 (read nothing), all sampled
    assert read(packed.token_ids) == [40, 41, 0, 0] and read(packed.positions) == [6, 2, 0, 0]
    assert read(packed.slot_mapping) == [9 * 4 + 2, 7 * 4 + 2, -1, -1]
    assert read(packed.decode_rows) == [0, 1, 2, 3] and read(packed.decode_contexts) == [7, 3, 0, 0]
    assert read(packed.decode_tables) == [[3, 9, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert read(packed.sample_rows) == [0, 1, 2, 3] and packed.num_prefill == 0
    assert read(packed.row_contexts) == [7, 3, 0, 0] and read(packed.row_tables) == [0, 1, 2, 3]
    # without query_rows (no indexer) the parts are empty: nothing packed for them
    plain = cuda_batch.pack_batch(build_batch(rows, BLOCK), region, max_blocks=3, pad_to=4)
    offset = (plain.decode_tables.ptr - region.ptr) // 4
    assert plain.row_contexts.shape == plain.row_tables.shape == (0,)
    assert plain.host[offset:offset + 12].reshape(4, 3).tolist() == [[3, 9, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert (packed.num_tokens, packed.num_decode) == (4, 4) and np.asarray(packed.host).dtype == np.int32


def test_pack_batch_pads_an_encoder_pass_to_its_graph():
    cuda_batch = pytest.importorskip("metrale.runtime.backend.cuda.batch")
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    region = DeviceTensor(1 << 32, (4096,), "int32")
    sources = [Segment(BlockTable([3]), 0, (40, 41, 42), False), Segment(BlockTable([7, 8]), 0, (50,), False)]
    padding = cuda_batch.PrefillPadding(tokens=8, segments=4, max_query=64)
    packed = cuda_batch.pack_batch(build_batch(sources, BLOCK), region, max_blocks=3, prefill=padding)

    def read(view):
        offset = (view.ptr - region.ptr) // 4
        return packed.host[offset:offset + view.numel].reshape(view.shape).tolist()
    # padding rows: token 0 at position 0, KV slot -1; padding segments: no rows, no context; the one-token
    # source goes to the prefill kernel with the others
    assert read(packed.token_ids) == [40, 41, 42, 50, 0, 0, 0, 0] and read(packed.positions) == [0, 1, 2, 0, 0, 0, 0, 0]
    assert read(packed.slot_mapping) == [12, 13, 14, 28, -1, -1, -1, -1]
    assert read(packed.prefill_starts) == [0, 3, 0, 0] and read(packed.prefill_lens) == [3, 1, 0, 0]
    assert read(packed.prefill_contexts) == [3, 1, 0, 0]
    assert read(packed.prefill_tables) == [[3, 0, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert read(packed.sample_rows) == [] and read(packed.decode_rows) == [] and read(packed.decode_contexts) == []
    assert (packed.num_tokens, packed.num_decode, packed.num_prefill, packed.max_prefill_query) == (8, 0, 4, 64)


def test_pack_batch_pads_a_decoder_prompt_pass_and_its_samples():
    """A prefill graph that samples (a decoder's prompts): each segment's last row, then row 0 up to the padded
    count (those logits are computed and dropped); the cross batch pads alike and samples nothing."""
    cuda_batch = pytest.importorskip("metrale.runtime.backend.cuda.batch")
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    region = DeviceTensor(1 << 32, (4096,), "int32")
    prompts = [Segment(BlockTable([3]), 0, (2, 250), True, (BlockTable([9, 10]), 6)),
               Segment(BlockTable([7]), 0, (2,), True, (BlockTable([11]), 3))]
    batch = build_batch(prompts, BLOCK)
    padding = cuda_batch.PrefillPadding(tokens=16, segments=4, max_query=2, sampled=4)
    packed = cuda_batch.pack_batch(batch, region, max_blocks=3, prefill=padding)
    cross = cuda_batch.pack_batch(batch.cross, region, max_blocks=3, prefill=padding._replace(sampled=0))

    def read(packed, view):
        offset = (view.ptr - region.ptr) // 4
        return packed.host[offset:offset + view.numel].reshape(view.shape).tolist()
    assert read(packed, packed.sample_rows) == [1, 2, 0, 0]
    assert read(packed, packed.token_ids) == [2, 250, 2] + [0] * 13
    assert read(packed, packed.prefill_lens) == [2, 1, 0, 0] and read(packed, packed.prefill_contexts) == [2, 1, 0, 0]
    assert read(cross, cross.sample_rows) == [] and read(cross, cross.slot_mapping) == [-1] * 16
    assert read(cross, cross.prefill_contexts) == [6, 3, 0, 0]
    assert read(cross, cross.prefill_tables) == [[9, 10, 0], [11, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert (packed.num_tokens, packed.num_prefill, packed.max_prefill_query) == (16, 4, 2)
    with pytest.raises(ValueError):     # fewer padded samples than the batch takes
        cuda_batch.pack_batch(batch, region, max_blocks=3, prefill=padding._replace(sampled=1))


def test_pack_batch_lays_out_state_slots_short_segments_before_long_ones():
    """A recurrent model's segments for its scan kernels: the ones longer than its scan chunk last (chunked), each
    with its rows and (source, destination) slots."""
    cuda_batch = pytest.importorskip("metrale.runtime.backend.cuda.batch")
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    region = DeviceTensor(1 << 32, (4096,), "int32")
    segments = [Segment(BlockTable([1, 2, 3]), 0, tuple(range(9)), True, state=(-1, 0)),
                Segment(BlockTable([5]), 2, (7,), True, state=(3, 4)),
                Segment(BlockTable([6, 7]), 0, tuple(range(5)), True, state=(-1, 6)),
                Segment(BlockTable([8, 9, 10]), 1, tuple(range(10)), True, state=(2, 2))]
    packed = cuda_batch.pack_batch(build_batch(segments, BLOCK), region, max_blocks=3, scan_chunk=5)

    def read(view):
        offset = (view.ptr - region.ptr) // 4
        return packed.host[offset:offset + view.numel].tolist()
    states = packed.states
    assert (states.count, states.max_len, states.long_count) == (4, 10, 2)
    short, long = states.short(), states.long()
    assert read(short.starts) == [9, 10] and read(short.lens) == [1, 5]
    assert read(short.sources) == [3, -1] and read(short.destinations) == [4, 6]
    assert read(long.starts) == [0, 15] and read(long.lens) == [9, 10]
    assert read(long.sources) == [-1, 2] and read(long.destinations) == [0, 2]
    assert (short.count, long.count, long.max_len) == (2, 2, 10) and short.max_len >= 5
    # Without a chunk, every segment is short, in batch order; other models' batches carry no state parts.
    plain = cuda_batch.pack_batch(build_batch(segments, BLOCK), region, max_blocks=3)
    assert plain.states.long_count == 0 and plain.states.short() is plain.states
    assert cuda_batch.pack_batch(build_batch(mixed_segments(), BLOCK), region, max_blocks=5).states is None


def test_pack_batch_pads_a_recurrent_decode_batch_with_rows_that_keep_nothing():
    cuda_batch = pytest.importorskip("metrale.runtime.backend.cuda.batch")
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    region = DeviceTensor(1 << 32, (4096,), "int32")
    rows = [Segment(BlockTable([3, 9]), 6, (40,), True, state=(0, 5)), Segment(BlockTable([7]), 2, (41,), True,
                                                                                state=(1, 6))]
    packed = cuda_batch.pack_batch(build_batch(rows, BLOCK), region, max_blocks=3, pad_to=4, scan_chunk=8)

    def read(view):
        offset = (view.ptr - region.ptr) // 4
        return packed.host[offset:offset + view.numel].tolist()
    states = packed.states
    assert (states.count, states.max_len, states.long_count) == (4, 1, 0)
    assert read(states.starts) == [0, 1, 2, 3] and read(states.lens) == [1, 1, 1, 1]
    assert read(states.sources) == [0, 1, -1, -1] and read(states.destinations) == [5, 6, -1, -1]
