"""A forward's metadata on the device: packed on the host into one int32 array, copied with one H2D copy
into a fixed region (the same addresses every forward, for CUDA graphs)."""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

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
    num_tokens: int
    num_decode: int
    num_prefill: int
    max_decode_context: int
    max_prefill_query: int
    host: np.ndarray              # kept alive until the forward is synchronized


class PrefillPadding(NamedTuple):
    """The fixed shapes of a prefill graph (an encoder pass): rows, segments, and the longest segment planned."""
    tokens: int
    segments: int
    max_query: int


def pack_batch(batch: ForwardBatch, region: DeviceTensor, max_blocks: int, pad_to: int = 0,
               prefill: PrefillPadding | None = None) -> CudaBatch:
    """Lays the batch out in `region` (int32, large enough: see metadata_elements). pad_to: the batch is pure
    decode (one token per segment, each sampled) and is padded to pad_to lanes that read and write nothing
    (context 0, KV slot -1), every lane sampled, in order: the fixed shapes of a decode graph. prefill: every
    segment goes to the prefill kernel (one-token ones too), padded to prefill.tokens rows (token 0, KV slot -1)
    and prefill.segments segments of no rows and no context, attention planned for prefill.max_query rows."""
    lens = batch.query_lens
    if pad_to:
        single, multi, pad = list(range(len(lens))), [], pad_to - batch.num_tokens
    elif prefill:
        single, multi, pad = [], list(range(len(lens))), prefill.tokens - batch.num_tokens
    else:
        single = [i for i, n in enumerate(lens) if n == 1]
        multi = [i for i, n in enumerate(lens) if n != 1]
        pad = 0
    segment_pad = prefill.segments - len(multi) if prefill else 0

    def tables(indices, rows):
        out = np.zeros((rows, max_blocks), dtype=np.int32)
        chosen = [batch.block_tables[i] for i in indices]
        counts = np.fromiter(map(len, chosen), dtype=np.int64, count=len(chosen))
        total = int(counts.sum())
        if total:
            flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in chosen])
            out[:len(chosen)][np.arange(max_blocks) < counts[:, None]] = flat   # row by row, in order
        return out

    def padded(values, fill, count=pad):
        return np.concatenate([np.asarray(values, dtype=np.int32), np.full(count, fill, dtype=np.int32)])

    starts, contexts = batch.query_starts, batch.context_lens
    parts = {
        "token_ids": padded(batch.token_ids.numpy(), 0), "positions": padded(batch.positions.numpy(), 0),
        "slot_mapping": padded(batch.slot_mapping.numpy(), -1),
        "sample_rows": np.arange(pad_to, dtype=np.int32) if pad_to else batch.sample_rows.numpy(),
        "decode_rows": np.arange(pad_to, dtype=np.int32) if pad_to else [starts[i] for i in single],
        "decode_contexts": padded([contexts[i] for i in single], 0, pad if pad_to else 0),
        "decode_tables": tables(single, len(single) + (pad if pad_to else 0)),
        "prefill_starts": padded([starts[i] for i in multi], 0, segment_pad),
        "prefill_lens": padded([lens[i] for i in multi], 0, segment_pad),
        "prefill_contexts": padded([contexts[i] for i in multi], 0, segment_pad),
        "prefill_tables": tables(multi, len(multi) + segment_pad),
    }
    arrays = [np.asarray(p, dtype=np.int32) for p in parts.values()]
    host = np.concatenate([a.ravel() for a in arrays])
    views, offset = {}, 0
    for name, array in zip(parts, arrays):
        views[name] = DeviceTensor(region.ptr + offset * 4, array.shape, "int32")
        offset += array.size
    return CudaBatch(**views, num_tokens=batch.num_tokens + pad, num_decode=len(single) + (pad if pad_to else 0),
                     num_prefill=len(multi) + segment_pad,
                     max_decode_context=max((contexts[i] for i in single), default=0),
                     max_prefill_query=prefill.max_query if prefill else max((lens[i] for i in multi), default=0),
                     host=host if offset else np.zeros(1, dtype=np.int32))


def metadata_elements(max_batch_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """int32 elements the metadata region needs at the most."""
    return 4 * max_batch_tokens + 2 * max_seqs * (3 + max_blocks) + 4 * max_seqs
