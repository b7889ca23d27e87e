"""A decode batch packed ahead of its launch (Runner.stage, while the step before it runs) uploads exactly the image a
batch packed at its launch uploads, its token ids set in place meanwhile included; prepared on another stream it
is packed again for that stream's region; a stream's timed rounds give each round's device time and the device's
idle time before it. No GPU needed: the stream contexts are host-side stand-ins."""

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.stream_context import MAX_PENDING, StreamContext  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.batch import Segment, build_batch  # noqa: E402
from metrale.runtime.sequence import BlockTable  # noqa: E402

BLOCK, MAX_BLOCKS = 16, 8


def stream(base: int):
    """What StreamContext.prepare, pack and stage read of a stream: its shapes, regions and copies."""
    ctx = SimpleNamespace(_prepared=None, _timing=False, uploads=[], _pending=[], waits=[],
                          ring=SimpleNamespace(reset=lambda: None),
                          shapes=SimpleNamespace(max_batch_tokens=64, max_seqs=16, max_blocks_per_seq=MAX_BLOCKS,
                                                 ssm_chunk_size=0, index_topk=0),
                          metadata=DeviceTensor(base, (4096,), "int32"),
                          cross_metadata=DeviceTensor(base + 1 << 20, (4096,), "int32"))
    ctx.copy_to_device = lambda dst, host: (ctx.uploads.append((dst.ptr, host.copy())), ctx._pending.append(host))
    ctx.synchronize = lambda: (ctx.waits.append(len(ctx._pending)), ctx._pending.clear())
    for name in ("prepare", "pack", "stage"):
        setattr(ctx, name, functools.partial(getattr(StreamContext, name), ctx))
    return ctx


def decode_batch(tokens):
    segments = [Segment(BlockTable([3 * i + 1, 3 * i + 2]), 20 + i, (t,), True) for i, t in enumerate(tokens)]
    return build_batch(segments, BLOCK)


def test_a_staged_batch_uploads_what_a_batch_packed_at_launch_uploads():
    ctx = stream(1 << 30)
    staged = decode_batch([0, 0, 0])
    ctx.stage(staged, pad_to=4)
    staged.token_ids.copy_(torch.tensor([7, 8, 9]))      # the successor's tokens, known at its launch
    ctx.prepare(staged, pad_to=4)
    ctx.prepare(decode_batch([7, 8, 9]), pad_to=4)
    (first_at, first), (second_at, second) = ctx.uploads
    assert first_at == second_at == ctx.metadata.ptr and np.array_equal(first, second)
    assert first[:4].tolist() == [7, 8, 9, 0]


def test_a_batch_staged_for_one_stream_is_packed_again_on_another():
    one, other = stream(1 << 30), stream(1 << 31)
    batch = decode_batch([5, 6])
    one.stage(batch, pad_to=2)
    staged_image = batch.staged[1]
    prepared = other.prepare(batch, pad_to=2)
    assert prepared is not staged_image and prepared.token_ids.ptr == other.metadata.ptr
    assert np.array_equal(other.uploads[0][1], staged_image.host)


def test_timed_rounds_give_each_rounds_device_time_and_the_idle_time_before_it():
    """StreamContext.take_rounds over events that subtract to ms (a CUDA event minus another is its elapsed ms)."""
    ctx = SimpleNamespace(synchronize=lambda: None, _timed_rounds=[(0.0, 4.0), (4.5, 9.0), (None, 9.5), (10.0, 12.0)])
    rounds = StreamContext.take_rounds(ctx)
    assert np.isnan(rounds[0][1]) and rounds[0][0] == 4.0
    assert rounds[1:] == [(4.5, 0.5), (2.0, 0.5)] and ctx._timed_rounds == []


def test_a_stream_never_waited_for_waits_for_its_device_before_its_copies_pile_up():
    """A tensor-parallel follower's stream samples nothing, so no read-back ever waits for it: before a forward, once
    it keeps more than MAX_PENDING host arrays alive for its queued copies, it waits for its device and lets them go."""
    ctx = stream(1 << 30)
    for _ in range(3 * MAX_PENDING):
        ctx.prepare(decode_batch([5]), pad_to=4)
    assert ctx.waits and all(waited == MAX_PENDING + 1 for waited in ctx.waits)
    assert len(ctx._pending) <= MAX_PENDING + 1
