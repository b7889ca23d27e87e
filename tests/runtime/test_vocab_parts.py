"""The CUDA backend's LM head over tensor-parallel ranks, without a GPU: the rows each rank holds, each stream's
logits buffers, and what the gathered logits queue (each rank's product at its place, the in-place gather's count,
rank 0's column copies)."""

from types import SimpleNamespace

import pytest
import torch

from metrale.runtime.parallel.group import Shard

pytest.importorskip("cuda.core")


def test_a_rank_holds_its_equal_part_of_the_vocabulary_padded_with_zero_rows():
    """1000 rows over 2 ranks: 512 each (a multiple of 64), the second's last 24 zeros; one device's padded to
    padded_vocab."""
    from metrale.runtime.backend.cuda.stream_context import padded_vocab
    from metrale.runtime.backend.cuda.vocab_parts import head_rows

    table = torch.randn(1000, 8)
    assert torch.equal(head_rows(table, None)[:1000], table) and head_rows(table, None).shape == (padded_vocab(1000), 8)
    assert not head_rows(table, None)[1000:].any()
    first, second = head_rows(table, Shard(0, 2)), head_rows(table, Shard(1, 2))
    assert first.shape == second.shape == (512, 8)
    assert torch.equal(first, table[:512]) and torch.equal(second[:488], table[512:]) and not second[488:].any()


def test_each_stream_holds_the_ranks_vocabulary_parts_side_by_side():
    """The CUDA backend's logits rows: as wide as every rank's part of the vocabulary (each padded to 64 rows), with
    the buffer the parts are gathered into, also for a group of one; one device's as before."""
    from metrale.runtime.backend.cuda.stream_context import padded_vocab, stream_buffers, vocab_part
    from metrale.runtime.backend.runner import MemoryShapes

    shapes = MemoryShapes(hidden=64, q_size=0, kv_size=0, intermediate=128, vocab=1000, max_batch_tokens=32,
                          max_seqs=8, max_blocks_per_seq=4, head_dim=16, kv_block_size=16)
    one = stream_buffers(None, shapes)
    assert one["logits"] == ((8, padded_vocab(1000)), "bfloat16") and "logits_parts" not in one
    for ranks in (1, 2, 3):
        buffers = stream_buffers(None, shapes, ranks)
        part = vocab_part(1000, ranks)
        assert part % 64 == 0 and ranks * part >= 1000 > (ranks - 1) * part
        assert buffers["logits"] == ((8, ranks * part), "bfloat16")
        assert buffers["logits_parts"] == ((ranks * 8 * part,), "bfloat16")


class GatherPlan:
    """What the CUDA layer math's gathered logits queue, recorded without a GPU: the LM head's linear (its output),
    the gather (its buffer and count) and rank 0's column copies (destination, source)."""

    def __init__(self):
        self.linears, self.gathers, self.copies = [], [], []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_logits_go_to_its_place_and_rank_0_lays_the_parts_side_by_side(rank, monkeypatch):
    """Rows 3 of a 1000-token vocabulary over 2 ranks (parts of 512 rows): the rank's product goes to its place in the
    gathered buffer (after rank 0's [3, 512]), the in-place gather counts one part's elements, and rank 0 copies part
    r into columns [512 r, 512 (r + 1)) of its logits rows (of the logits buffer's stride); the vocab's columns come
    back."""
    from metrale.runtime.backend.cuda import layer_math, vocab_parts
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    plan, base = GatherPlan(), 1 << 32
    monkeypatch.setattr(vocab_parts, "linear_into", lambda lib, gemm, ctx, out, x, weight: plan.linears.append(out))
    ctx = SimpleNamespace(stream="stream", logits=DeviceTensor(base, (8, 1024), "bfloat16"),
                          logits_parts=DeviceTensor(base + (1 << 20), (2 * 8 * 512,), "bfloat16"))
    resources = SimpleNamespace(
        cuda=SimpleNamespace(copy_columns=lambda dst, src, stream: plan.copies.append((dst, src))), lib=None,
        gemm=None, bound=SimpleNamespace(context=ctx), shapes=SimpleNamespace(vocab=1000), shard=Shard(rank, 2),
        collectives=SimpleNamespace(all_gather=lambda parts, count, stream: plan.gathers.append((parts, count))))
    math = layer_math.CudaLayerMath(resources)
    out = math.logits(DeviceTensor(base + (1 << 24), (3, 64), "bfloat16"), DeviceTensor(0, (512, 64), "bfloat16"))
    parts = ctx.logits_parts.ptr
    assert plan.linears == [DeviceTensor(parts + rank * 3 * 512 * 2, (3, 512), "bfloat16")]
    assert plan.gathers == [(ctx.logits_parts, 3 * 512)]
    expected = [(DeviceTensor(base + r * 512 * 2, (3, 512), "bfloat16", 1024),
                 DeviceTensor(parts + r * 3 * 512 * 2, (3, 512), "bfloat16")) for r in (0, 1)]
    assert plan.copies == (expected if rank == 0 else [])
    assert out == DeviceTensor(base, (3, 1000), "bfloat16", 1024)
