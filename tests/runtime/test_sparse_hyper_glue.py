"""The CUDA backend's glue of sparse attention and hyper-connections without a GPU: a stream's buffers as
stream_buffers sizes them, and the launches sparse_selection.select and hyper_connection's ops make over them (every
launcher's checks pass; the rows scored in pieces the scores buffer holds; a decode entry's selection gathered
once)."""

import types

import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import BASE, FakeLibrary, bf16, f32, i32, record_launches  # noqa: E402
from metrale.runtime.backend.cuda import hyper_connection, kernels, sparse_selection  # noqa: E402
from metrale.runtime.backend.cuda.stream_context import index_score_rows  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.backend.layer_math import HyperConnection, HyperHead, RopeTable, SparseIndexer  # noqa: E402

TOKENS, SEQS, HEADS, DIM, TOPK, HIDDEN, BLOCK, BLOCKS = 40, 8, 16, 64, 32, 256, 16, 64


class FakeContext:
    """A stream context's buffers at made-up addresses, each its own region."""

    def __init__(self, score_rows: int, max_context: int, hc_mult: int = 4):
        self.stream, self._next = None, BASE

        def take(shape, dtype):
            tensor = DeviceTensor(self._next, shape, dtype)
            self._next += -(-tensor.nbytes // 256) * 256
            return tensor
        self.take = take
        kept = min(TOPK, max_context)         # as stream_buffers sizes them
        self.index = {"weights": take((TOKENS, HEADS), "float32"), "scores": take((score_rows, max_context), "float32"),
                      "selected": take((TOKENS, kept), "int32"), "counts": take((TOKENS,), "int32"),
                      "decode_selected": take((SEQS, kept), "int32"), "decode_counts": take((SEQS, 1), "int32"),
                      "rows": take((TOKENS,), "int32")}
        self.hyper = {"streams": take((TOKENS, hc_mult * HIDDEN), "bfloat16"),
                      "post": take((TOKENS, hc_mult), "float32"), "comb": take((TOKENS, hc_mult * hc_mult), "float32"),
                      **{name: take(*spec) for name, spec in kernels.hyper.SCRATCH_SHAPES.items()}}

    def new(self, rows, cols, dtype="bfloat16"):
        return self.take((rows, cols), dtype)


def batch(decode: int, prefill: int = 2):
    return types.SimpleNamespace(positions=i32(TOKENS), slot_mapping=i32(TOKENS), row_contexts=i32(TOKENS),
                                 row_tables=i32(TOKENS), tables=i32(SEQS + 4, 20), decode_rows=i32(decode),
                                 num_decode=decode, num_prefill=prefill)


@pytest.mark.parametrize("score_rows, max_context", [(TOKENS, 20 * BLOCK), (16, 20 * BLOCK), (TOKENS, BLOCK)])
def test_select_scores_every_row_in_pieces_and_gathers_mixed_decode_entries_once(monkeypatch, score_rows,
                                                                                 max_context):
    """A top-k past the longest context keeps at most that context (BLOCK tokens here: every one)."""
    recorded = record_launches(monkeypatch, kernels.sparse_index, kernels.embedding)
    ctx = FakeContext(score_rows, max_context)
    kept = min(TOPK, max_context)
    indexer = SparseIndexer(f32(HEADS, HIDDEN), HEADS, DIM, 16, False, TOPK)
    rope = RopeTable(f32(512, 8), f32(512, 8))
    selection = sparse_selection.select(FakeLibrary(), ctx, bf16(TOKENS, HEADS * DIM), bf16(TOKENS, DIM),
                                        bf16(TOKENS, HIDDEN), indexer, rope, batch(6), bf16(BLOCKS, BLOCK, DIM))
    names = [name for (_, name), *_ in recorded]
    pieces = -(-TOKENS // score_rows)
    assert names[:2] == ["rope_and_write_index", "index_weights"]
    assert names[2:] == ["index_scores_d64", "index_top_k"] * pieces
    assert (selection.by_row.shape, selection.counts.shape, selection.width) == ((TOKENS, kept), (TOKENS,), kept)
    assert all(args[-2] == kept for (_, name), _, _, args, _ in recorded if name == "index_top_k")
    # each piece's rows of the batch's per-row parts (row_contexts and row_tables both at BASE here)
    scored = [args for (_, name), _, _, args, _ in recorded if name == "index_scores_d64"]
    chosen = [args for (_, name), _, _, args, _ in recorded if name == "index_top_k"]
    for start, score_args, top_args in zip(range(0, TOKENS, score_rows), scored, chosen):
        assert [int(score_args[i]) for i in (7, 8, 10)] == [ctx.index["rows"].ptr + 4 * start, BASE + 4 * start,
                                                            BASE + 4 * start]
        assert [int(top_args[i]) for i in (0, 2, 5)] == [ctx.index["selected"].ptr + 4 * kept * start,
                                                         ctx.index["counts"].ptr + 4 * start, BASE + 4 * start]
    selected, counts = selection.decode(FakeLibrary(), ctx, batch(6))
    assert selection.decode(FakeLibrary(), ctx, batch(6)) == (selected, counts)
    assert [name for (_, name), *_ in recorded[2 + 2 * pieces:]] == ["gather_rows_16b", "gather_rows_4b"]
    assert selected.shape == (6, kept) and counts.shape == (6,)
    # decode rows alone: entry i is row i, nothing gathered
    selected, counts = selection.decode(FakeLibrary(), ctx, batch(6, prefill=0))
    assert (selected.ptr, counts.ptr) == (selection.by_row.ptr, selection.counts.ptr)
    assert len(recorded) == 4 + 2 * pieces


def test_the_scores_buffer_holds_a_piece_within_its_budget():
    assert index_score_rows(8192, 32768) == 512 and index_score_rows(8192, 1 << 30) == 1
    assert index_score_rows(64, 1024) == 64


@pytest.mark.parametrize("sinkhorn_iters", [0, 20])
def test_hyper_ops_run_in_the_streams_buffers(monkeypatch, sinkhorn_iters):
    recorded = record_launches(monkeypatch, kernels.hyper)
    ctx, lib, n = FakeContext(TOKENS, 64), FakeLibrary(), 4
    rows = (2 + (n if sinkhorn_iters else 0)) * n
    hc = HyperConnection(f32(rows, n * HIDDEN), f32(rows), f32(3 if sinkhorn_iters else 2), n, 1e-6, 1e-6, 2.0,
                         0.0, sinkhorn_iters)
    streams = hyper_connection.widen(lib, ctx, bf16(TOKENS, HIDDEN), n)
    assert streams.ptr == ctx.hyper["streams"].ptr
    x, mix = hyper_connection.collapse(lib, ctx, streams, hc)
    assert (mix.comb is None) == (not sinkhorn_iters) and x.shape == (TOKENS, HIDDEN)
    after, x, mix_after = hyper_connection.boundary(lib, ctx, bf16(TOKENS, HIDDEN), streams, mix, hc)
    assert after is streams and mix_after is mix
    hyper_connection.expand(lib, ctx, x, streams, mix)
    out = hyper_connection.head(lib, ctx, streams, HyperHead(f32(n, n * HIDDEN), f32(n), f32(1), n, 1e-6, 1e-6))
    assert out.shape == (TOKENS, HIDDEN)
    assert [name for (_, name), *_ in recorded] == ["hyper_widen", "hyper_collapse", "hyper_boundary", "hyper_expand",
                                                    "hyper_head"]
    scratch = [ctx.hyper["partials"].ptr, ctx.hyper["arrivals"].ptr]
    assert all(args[-3:-1] == scratch for (_, name), _, _, args, _ in recorded if name != "hyper_widen"
               and name != "hyper_expand")          # a few tokens' pieces meet in the stream's scratch
