"""A forward's metadata on the device: packed on the host into one int32 array, copied with one H2D copy
into a fixed region (the same addresses every forward, for CUDA graphs)."""

from dataclasses import dataclass

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


def pack_batch(batch: ForwardBatch, region: DeviceTensor, max_blocks: int) -> CudaBatch:
    """Lays the batch out in `region` (int32, large enough: see metadata_elements)."""
    single = [i for i, n in enumerate(batch.query_lens) if n == 1]
    multi = [i for i, n in enumerate(batch.query_lens) if n != 1]

    def tables(indices):
        out = np.zeros((len(indices), max_blocks), dtype=np.int32)
        for row, i in enumerate(indices):
            out[row, :len(batch.block_tables[i])] = batch.block_tables[i].numpy()
        return out

    parts = {
        "token_ids": batch.token_ids.numpy(), "positions": batch.positions.numpy(),
        "slot_mapping": batch.slot_mapping.numpy(), "sample_rows": batch.sample_rows.numpy(),
        "decode_rows": np.array([batch.query_starts[i] for i in single]),
        "decode_contexts": np.array([batch.context_lens[i] for i in single]),
        "decode_tables": tables(single),
        "prefill_starts": np.array([batch.query_starts[i] for i in multi]),
        "prefill_lens": np.array([batch.query_lens[i] for i in multi]),
        "prefill_contexts": np.array([batch.context_lens[i] for i in multi]),
        "prefill_tables": tables(multi),
    }
    host = np.concatenate([np.asarray(p, dtype=np.int32).ravel() for p in parts.values()]) if parts else None
    views, offset = {}, 0
    for name, part in parts.items():
        shape = np.asarray(part).shape
        count = int(np.prod(shape))
        views[name] = DeviceTensor(region.ptr + offset * 4, shape if len(shape) else (0,), "int32")
        offset += count
    return CudaBatch(**views, num_tokens=batch.num_tokens,
                     num_decode=len(single), num_prefill=len(multi),
                     max_decode_context=max((batch.context_lens[i] for i in single), default=0),
                     max_prefill_query=max((batch.query_lens[i] for i in multi), default=0),
                     host=host[:offset] if offset else np.zeros(1, dtype=np.int32))


def metadata_elements(max_batch_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """int32 elements the metadata region needs at the most."""
    return 4 * max_batch_tokens + 2 * max_seqs * (3 + max_blocks) + 4 * max_seqs
