"""Decode steps as CUDA graphs: one graph per stream and bucketed batch size, captured once, replayed with
new inputs.

A decode forward is a fixed sequence of launches once its shapes are fixed: the batch is padded to its
bucket with rows that read and write nothing (context 0, KV slot -1), the metadata is copied into the same
region with the same layout, the activation workspace is reset to the same addresses, and attention is
planned for max_model_len so its split count does not depend on the rows' contexts. An encoder-decoder's
graphs hold its cross-attention batch too, padded alike in its own region and planned for the longest source.
Its encoder passes and its decoder's prompts replay graphs too (PrefillGraphs): one per padded shape of rows,
segments, longest segment and sampled rows.
"""

import contextlib
import dataclasses
import gc
import threading
from typing import Callable

import torch

from metrale.runtime.backend.cuda.batch import PrefillPadding, pack_batch
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.batch import ForwardBatch


class DecodeGraphs:
    """One stream's graphs: captured over its buffers, launched on its stream."""

    def __init__(self, ctx, batch_sizes: tuple[int, ...], max_context: int, max_source_len: int = 0,
                 recurrent: bool = False):
        """max_source_len > 0: an encoder-decoder's graphs, each step with its cross-attention batch. recurrent: a
        model with recurrent layers, whose steps carry state slots (padding rows read zeros and keep nothing)."""
        self.ctx, self.recurrent = ctx, recurrent
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_context, self.max_source_len = max_context, max_source_len
        self._graphs: dict[int, tuple[object, DeviceTensor]] = {}
        self._layouts: dict[int, tuple] = {}
        self.replays = 0

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The graph size a forward fits, or None: not a pure decode step (with a cross batch exactly where the
        graphs have one), or larger than every bucket."""
        if (batch.cross is not None) != (self.max_source_len > 0):
            return None
        return decode_bucket(batch, self.batch_sizes)

    def run(self, forward: Callable, batch: ForwardBatch, size: int) -> DeviceTensor:
        """Logits [B, vocab] of the batch's rows, from the bucket's graph (captured on first use)."""
        prepared = self._prepare(batch, size)
        if size not in self._graphs:
            self._graphs[size] = self._capture(forward, batch, prepared)
        graph, logits = self._graphs[size]
        graph.launch(self.ctx.stream)
        self.replays += 1
        return logits.rows(0, batch.num_tokens)

    def capture_all(self, forward: Callable) -> None:
        """Warm-up, on a thread bound to this stream (forward's ops run on the calling thread's stream): every bucket
        captured with padding rows only."""
        for size in self.batch_sizes:
            self._captured(forward, size)

    def forget(self) -> None:
        """Closes every captured graph (each is captured again on its next use): what they captured is going (a
        tensor-parallel communicator, whose abort waits for them)."""
        _close_all(self._graphs)

    def size_for(self, rows: int) -> int | None:
        """The smallest bucket of at least `rows` decode rows, or None."""
        return next((size for size in self.batch_sizes if size >= rows), None)

    def layout(self, size: int) -> tuple:
        """The metadata views (and cross views) a bucket's graph reads, for a caller that writes them on the
        device (the beam search step) and then calls replay()."""
        if size in self._layouts:
            return self._layouts[size]
        empty = empty_decode_batch(self.max_source_len > 0, self.recurrent)
        max_blocks = self.ctx.shapes.max_blocks_per_seq
        prepared = pack_batch(empty, self.ctx.metadata, max_blocks, pad_to=size,
                              query_rows=self.ctx.shapes.index_topk > 0)
        cross = (pack_batch(empty.cross, self.ctx.cross_metadata, max_blocks, pad_to=size)
                 if self.max_source_len else None)
        self._layouts[size] = prepared, cross
        return prepared, cross

    def rehearse(self, forward: Callable, size: int) -> None:
        """forward over the bucket's padded empty batch, eagerly: the launches its capture would record, run once
        (a linear's algorithm is tuned on its first call, which a capture cannot time)."""
        empty = empty_decode_batch(self.max_source_len > 0, self.recurrent)
        with self.ctx.reuse_prepared(*self._prepare(empty, size)):
            forward(empty)

    def stage(self, batch: ForwardBatch, size: int) -> None:
        """The batch's metadata (and its cross batch's) packed ahead of its run (StreamContext.stage)."""
        self.ctx.stage(batch, pad_to=size)
        if batch.cross is not None:
            self.ctx.stage(batch.cross, pad_to=size, cross=True)

    def capture(self, forward: Callable, size: int) -> None:
        """The bucket's graph, captured now if it is not yet: before a caller writes the metadata replay() reads
        (capturing lays padding metadata over the region)."""
        self._captured(forward, size)

    def replay(self, size: int) -> DeviceTensor:
        """The bucket's graph (capture()) over the metadata already in place (layout()); logits [size, vocab]."""
        graph, logits = self._graphs[size]
        graph.launch(self.ctx.stream)
        self.replays += 1
        return logits

    def _captured(self, forward: Callable, size: int) -> tuple[object, DeviceTensor]:
        if size not in self._graphs:
            empty = empty_decode_batch(self.max_source_len > 0, self.recurrent)
            self._graphs[size] = self._capture(forward, empty, self._prepare(empty, size))
        return self._graphs[size]

    def _prepare(self, batch: ForwardBatch, size: int) -> tuple:
        """The batch's metadata (and its cross batch's) padded to `size` rows, attention planned for max_context
        and max_source_len (not the rows' own contexts), so the captured launches fit every replay."""
        prepared = self.ctx.prepare(batch, pad_to=size)
        prepared.max_decode_context = self.max_context
        if batch.cross is None:
            return prepared, None
        cross = self.ctx.prepare(batch.cross, pad_to=size, cross=True)
        cross.max_decode_context = self.max_source_len
        return prepared, cross

    def _capture(self, forward: Callable, batch: ForwardBatch, prepared) -> tuple[object, DeviceTensor]:
        """The graph of forward(batch) over `prepared` (the batch padded to its bucket), and its logits."""
        return capture(self.ctx, lambda: forward(batch), prepared)


class PrefillGraphs:
    """Prefill-shaped forwards on one stream as CUDA graphs, one per padded shape, captured on first use: an
    encoder-decoder's encoder passes (PrefillGraphs.encoder) and its decoder's prompts (PrefillGraphs.prompts: a
    beam search's start and target-language tokens). The rows, the segments, the longest segment and the sampled
    rows are each rounded up to a power of two (at least min_rows, 1, min_query and 1). Padding rows write no KV
    (slot -1), padding segments have no rows and no context, padding samples read row 0 (their logits are
    computed, not returned). An eager pass is ~150 launches (~6 ms of host time at 16 sources on the H200's host);
    a replay is one launch."""

    def __init__(self, ctx, min_rows: int, min_query: int):
        self.ctx, self.min_rows, self.min_query = ctx, min_rows, min_query
        self._graphs: dict[PrefillPadding, tuple[object, object]] = {}
        self.replays = 0

    @classmethod
    def encoder(cls, ctx) -> "PrefillGraphs":
        return cls(ctx, min_rows=64, min_query=64)

    @classmethod
    def prompts(cls, ctx) -> "PrefillGraphs":
        """A few tokens a segment: rows from 16, segments planned for their own length."""
        return cls(ctx, min_rows=16, min_query=1)

    def padding(self, batch: ForwardBatch) -> PrefillPadding | None:
        """The graph shape the batch pads to, or None where the padded rows, segments or sampled rows exceed the
        stream's plan, or where a segment samples more than its last row."""
        shapes, sampled = self.ctx.shapes, len(batch.sample_rows)
        padding = PrefillPadding(_power_of_two(max(batch.num_tokens, self.min_rows)),
                                 _power_of_two(len(batch.query_lens)),
                                 _power_of_two(max(max(batch.query_lens, default=1), self.min_query)),
                                 _power_of_two(sampled) if sampled else 0)
        if (padding.tokens > shapes.max_batch_tokens or max(padding.segments, padding.sampled) > shapes.max_seqs
                or sampled > len(batch.query_lens)):
            return None
        return padding

    def run(self, forward: Callable[[ForwardBatch], object], batch: ForwardBatch):
        """forward(batch) from its shape's graph, or eagerly where no graph shape fits: what forward returns (the
        sampled rows' logits, where it samples). A cross batch (batch.cross) pads as the batch, sampling none."""
        padding = self.padding(batch)
        if padding is None:
            return forward(batch)
        prepared = self.ctx.prepare(batch, prefill=padding)
        cross = (None if batch.cross is None
                 else self.ctx.prepare(batch.cross, cross=True, prefill=padding._replace(sampled=0)))
        if padding not in self._graphs:
            self._graphs[padding] = capture(self.ctx, lambda: forward(batch), (prepared, cross))
        graph, out = self._graphs[padding]
        graph.launch(self.ctx.stream)
        self.replays += 1
        return out.rows(0, len(batch.sample_rows)) if padding.sampled else out

    def forget(self) -> None:
        """As DecodeGraphs.forget."""
        _close_all(self._graphs)


def _close_all(graphs: dict) -> None:
    """Every (graph, output) of a shape-keyed dict closed, and the dict emptied."""
    for graph, _ in graphs.values():
        graph.close()
    graphs.clear()


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def capture(ctx, run: Callable[[], object], prepared: tuple) -> tuple[object, object]:
    """The graph of run()'s launches on the stream's stream, its model reading `prepared` (the batch and cross batch
    already in the stream's metadata regions), and what run() returned. If run() raises, the capture is ended (the
    stream serves on) and the error goes up."""
    stream = ctx.stream
    stream.sync()
    builder = stream.create_graph_builder()
    with no_collection():
        builder.begin_building("thread_local")
        try:
            with ctx.reuse_prepared(*prepared):
                result = run()
        except BaseException:
            with contextlib.suppress(Exception):        # the error to raise is run()'s
                builder.end_building()
            with contextlib.suppress(Exception):
                builder.close()     # what it captured goes (a tensor-parallel collective holds its communicator)
            raise
        builder.end_building()
    graph = builder.complete()
    graph.upload(stream)
    return graph, result


# Streams capture on their own threads, and an encoder graph may be captured while another stream serves: the collector
# stays off from the first capture's start to the last one's end.
_captures_lock = threading.Lock()
_captures, _collector_was_on = 0, True


@contextlib.contextmanager
def no_collection():
    """No cyclic garbage collection while a graph is captured: a device buffer that the collector frees frees
    its memory on a stream (cuMemFreeAsync), which the capture forbids and which would invalidate it. What is
    garbage already goes first, before any capture is under way."""
    global _captures, _collector_was_on
    with _captures_lock:
        if _captures == 0:
            gc.collect()
            _collector_was_on = gc.isenabled()
            gc.disable()
        _captures += 1
    try:
        yield
    finally:
        with _captures_lock:
            _captures -= 1
            if _captures == 0 and _collector_was_on:
                gc.enable()


def decode_bucket(batch: ForwardBatch, batch_sizes: tuple[int, ...]) -> int | None:
    """The smallest of the ascending batch_sizes a pure decode step (one token a segment, every row sampled) fits;
    None for any other forward, or one larger than every size."""
    if batch.query_lens.count(1) != len(batch.query_lens) or not batch.samples_every_row:
        return None
    return next((size for size in batch_sizes if size >= batch.num_tokens), None)


def empty_decode_batch(encoder_decoder: bool, recurrent: bool = False) -> ForwardBatch:
    """A batch of no rows (padded to a bucket, every row padding), with an empty cross batch for encoder-decoders
    and no state slots for recurrent models: what a graph is captured over, and what a forward over metadata written
    on the device is given."""
    empty = ForwardBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                         torch.zeros(0, dtype=torch.int64), [], [], [], [], torch.zeros(0, dtype=torch.int64))
    if encoder_decoder:
        empty.cross = dataclasses.replace(empty)
    if recurrent:
        empty.state_slots = []
    return empty
