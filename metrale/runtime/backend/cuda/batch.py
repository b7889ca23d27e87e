"""A forward's metadata on the device: packed on the host into one int32 array, copied with one H2D copy
into a fixed region (the same addresses every forward, for CUDA graphs)."""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from metrale.runtime.backend.cuda.kernels.ssm import Segments
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.batch import ForwardBatch


@dataclass
class CudaBatch:
    token_ids: DeviceTensor       # [T] int32
    positions: DeviceTensor       # [T] int32
    slot_mapping: DeviceTensor    # [T] int32
    sample_rows: DeviceTensor     # [N] int32
    # One-token segments, for the decode attention kernel.
    decode_rows: DeviceTensor     # [B] int32 row of T
    decode_contexts: DeviceTensor  # [B] int32
    decode_tables: DeviceTensor   # [B, max_blocks] int32
    # Longer segments, for the prefill attention kernel.
    prefill_starts: DeviceTensor  # [S] int32
    prefill_lens: DeviceTensor    # [S] int32
    prefill_contexts: DeviceTensor  # [S] int32
    prefill_tables: DeviceTensor  # [S, max_blocks] int32
    # Every row as a query over its causal context (sparse attention's indexer; empty unless packed with query_rows):
    # the context (position + 1; 0 for a padding row) and its block table's row in `tables` (decode_tables then
    # prefill_tables, back to back).
    row_contexts: DeviceTensor    # [T] int32
    row_tables: DeviceTensor      # [T] int32
    num_tokens: int
    num_decode: int
    num_prefill: int
    max_decode_context: int
    max_prefill_query: int
    # Every row becomes logits, in order (sample_rows is 0 .. T-1): sampled_rows gathers nothing.
    samples_every_row: bool
    host: np.ndarray              # kept alive until the forward is synchronized
    # Models with recurrent layers: every segment's rows and (source, destination) state slots, for the SSM kernels.
    states: Segments | None = None
    # The prefill segments' contexts and block tables on the host (None in a prefill graph's padded batch), and
    # what multi-head latent attention plans from them at its first layer (latent_prefill.py).
    prefill_spans: tuple[tuple[int, ...], tuple] | None = None
    latent_plan: object = None

    @property
    def tables(self) -> DeviceTensor:
        """decode_tables then prefill_tables as one [B + S, max_blocks] table (row_tables indexes it)."""
        rows = self.decode_tables.shape[0] + self.prefill_tables.shape[0]
        return DeviceTensor(self.decode_tables.ptr, (rows, self.decode_tables.shape[1]), "int32")


class PrefillPadding(NamedTuple):
    """The fixed shapes of a prefill graph (an encoder pass, a decoder's short prompts): rows, segments, the longest
    segment planned, and the sampled rows (0: none)."""
    tokens: int
    segments: int
    max_query: int
    sampled: int = 0


def pack_batch(batch: ForwardBatch, region: DeviceTensor, max_blocks: int, pad_to: int = 0,
               prefill: PrefillPadding | None = None, scan_chunk: int = 0, query_rows: bool = False) -> CudaBatch:
    """Lays the batch out in `region` (int32, large enough: see metadata_elements). pad_to: the batch is pure
    decode (one token per segment, each sampled) and is padded to pad_to rows that read and write nothing
    (context 0, KV slot -1), every row sampled, in order: the fixed shapes of a decode graph. scan_chunk: a recurrent
    model's scan chunk (segments longer than it go last in the state parts, Segments.long). prefill: every
    segment goes to the prefill kernel (one-token ones too), padded to prefill.tokens rows (token 0, KV slot -1)
    and prefill.segments segments of no rows and no context, attention planned for prefill.max_query rows, the
    sampled rows padded to prefill.sampled with row 0 (at least as many as the batch samples), so never every row
    in order (samples_every_row is False). query_rows: row_contexts and row_tables filled (a model with sparse
    attention's indexer; empty for the others, whose steps need not pay for them)."""
    lens, starts, contexts, n = batch.query_lens, batch.query_starts, batch.context_lens, batch.num_tokens
    if pad_to:
        single, multi, pad = range(len(lens)), (), pad_to - n
    elif prefill:
        single, multi, pad = (), range(len(lens)), prefill.tokens - n
    else:
        single = [i for i, q in enumerate(lens) if q == 1]
        multi = [i for i, q in enumerate(lens) if q != 1]
        pad = 0
    decode, segments = len(single), len(multi)
    decode_rows = decode + (pad if pad_to else 0)
    prefill_rows = segments + (prefill.segments - segments if prefill else 0)
    rows, sampled = n + pad, pad_to or (prefill.sampled if prefill else len(batch.sample_rows))
    # name: shape; the parts back to back in this order, one int32 image
    # (decode_tables and prefill_tables last and back to back: CudaBatch.tables)
    shapes = {"token_ids": (rows,), "positions": (rows,), "slot_mapping": (rows,), "sample_rows": (sampled,),
              "decode_rows": (decode_rows,), "decode_contexts": (decode_rows,), "prefill_starts": (prefill_rows,),
              "prefill_lens": (prefill_rows,), "prefill_contexts": (prefill_rows,),
              "row_contexts": (rows if query_rows else 0,), "row_tables": (rows if query_rows else 0,),
              "decode_tables": (decode_rows, max_blocks),
              "prefill_tables": (prefill_rows, max_blocks)}
    recurrent = batch.state_slots is not None
    state_segments = pad_to or (prefill.segments if prefill else len(lens))
    if recurrent:
        shapes.update({name: (state_segments,) for name in STATE_PARTS})
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += shape[0] * (shape[1] if len(shape) > 1 else 1)
    host = np.zeros(max(total, 1), dtype=np.int32)        # padding is 0 but for the KV slots (-1)

    def part(name: str) -> np.ndarray:
        shape = shapes[name]
        return host[offsets[name]:offsets[name] + math.prod(shape)].reshape(shape)

    part("token_ids")[:n] = batch.token_ids.numpy()
    part("positions")[:n] = batch.positions.numpy()
    slots = part("slot_mapping")
    slots[:n] = batch.slot_mapping.numpy()
    slots[n:] = -1
    if pad_to:
        part("sample_rows")[:] = np.arange(pad_to)
    else:
        part("sample_rows")[:len(batch.sample_rows)] = batch.sample_rows.numpy()
    part("decode_rows")[:] = np.arange(pad_to) if pad_to else [starts[i] for i in single]
    if query_rows:
        part("row_contexts")[:n] = part("positions")[:n] + 1
        _fill_row_tables(part("row_tables"), part("decode_rows")[:decode], starts, lens, multi, decode_rows, pad_to)
    if decode:
        part("decode_contexts")[:decode] = [contexts[i] for i in single]
        _fill_tables(part("decode_tables"), [batch.block_tables[i] for i in single])
    if segments:
        part("prefill_starts")[:segments] = [starts[i] for i in multi]
        part("prefill_lens")[:segments] = [lens[i] for i in multi]
        part("prefill_contexts")[:segments] = [contexts[i] for i in multi]
        _fill_tables(part("prefill_tables"), [batch.block_tables[i] for i in multi])
    long_count = 0
    if recurrent:
        order = np.arange(len(lens))
        if scan_chunk and not pad_to and not prefill:     # the long segments last, in row order (Segments.long)
            is_long = np.asarray(lens) > scan_chunk
            order, long_count = np.argsort(is_long, kind="stable"), int(is_long.sum())
        _fill_states(batch, order, part, pad_to)
    views = {name: DeviceTensor(region.ptr + offsets[name] * 4, shape, "int32") for name, shape in shapes.items()}
    states = None
    if recurrent:
        states = Segments(*(views.pop(name) for name in STATE_PARTS), count=state_segments,
                          max_len=1 if pad_to else (prefill.max_query if prefill else max(lens, default=0)),
                          long_count=long_count)
    return CudaBatch(**views, states=states, num_tokens=rows, num_decode=decode_rows, num_prefill=prefill_rows,
                     max_decode_context=max((contexts[i] for i in single), default=0),
                     max_prefill_query=prefill.max_query if prefill else max((lens[i] for i in multi), default=0),
                     samples_every_row=bool(pad_to) or (not prefill and batch.samples_every_row), host=host,
                     prefill_spans=None if prefill else (tuple(contexts[i] for i in multi),
                                                         tuple(batch.block_tables[i] for i in multi)))


STATE_PARTS = ("state_starts", "state_lens", "state_sources", "state_destinations")


def _fill_row_tables(out: np.ndarray, single_rows: np.ndarray, starts, lens, multi, decode_rows: int,
                     pad_to: int) -> None:
    """Each row's block table in CudaBatch.tables: its decode entry's (single_rows: the entries' rows), or
    decode_rows + its prefill segment's."""
    if pad_to:
        out[:] = np.arange(pad_to)
        return
    out[single_rows] = np.arange(len(single_rows))
    for segment, i in enumerate(multi):
        out[starts[i]:starts[i] + lens[i]] = decode_rows + segment


def _fill_states(batch: ForwardBatch, order: np.ndarray, part, pad_to: int) -> None:
    """The segments' rows and state slots, in `order`; padding segments (a graph's) read zeros and keep nothing
    (slots -1): a decode graph's one row each, a prefill graph's none."""
    count = len(order)
    slots = np.asarray(batch.state_slots, dtype=np.int32).reshape(-1, 2)[order]
    part("state_starts")[:count] = np.asarray(batch.query_starts)[order]
    part("state_lens")[:count] = np.asarray(batch.query_lens)[order]
    part("state_sources")[:count], part("state_destinations")[:count] = slots[:, 0], slots[:, 1]
    part("state_sources")[count:] = part("state_destinations")[count:] = -1
    if pad_to:
        part("state_starts")[count:] = np.arange(count, pad_to)
        part("state_lens")[count:] = 1


def set_tokens(prepared: CudaBatch, token_ids) -> None:
    """The batch's token ids (a [T] int64 tensor) into its packed image, which starts with them."""
    prepared.host[:len(token_ids)] = token_ids.numpy()


def _fill_tables(out: np.ndarray, tables: list) -> None:
    """Each block table (an int32 array or a list) into the start of its row of `out`, the rest left as it is."""
    if len(tables) <= 32:           # a row at a time is cheaper for a few
        for row, table in zip(out, tables):
            row[:len(table)] = table
        return
    counts = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tables])
    out[:len(tables)][np.arange(out.shape[1]) < counts[:, None]] = flat     # row by row, in order


def padded_rows(rows: list, width: int) -> np.ndarray:
    """Lists (or int32 arrays) of at most `width` ids as the rows of an int32 array, zero-padded on the right."""
    out = np.zeros((len(rows), width), dtype=np.int32)
    _fill_tables(out, rows)
    return out


def metadata_elements(max_batch_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """int32 elements the metadata region needs at the most."""
    return 6 * max_batch_tokens + 2 * max_seqs * (3 + max_blocks) + 4 * max_seqs + len(STATE_PARTS) * max_seqs
