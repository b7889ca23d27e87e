"""Launchers for cuda_kernels/beam_step.cu: a beam search step's select, fork and next-forward metadata, over a
call's state on the device (runtime/backend/cuda/beam_search.py lays it out; `state` is its address)."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "beam_step"
SELECT_THREADS = 256
FORK_THREADS = 1024
METADATA_THREADS = 64        # a row's table entries, side by side
SEED_THREADS = 256


def beam_seed(lib, stream, cand_ids: DeviceTensor, cand_values: DeviceTensor, ids: DeviceTensor,
              values: DeviceTensor, rows: DeviceTensor) -> None:
    """cand_ids and cand_values [beams, count] (the state's first candidates) = rows `rows` [beams] of ids and
    values [N, count] (the prompt pass's beam_candidates), on the device."""
    beams, count = cand_ids.shape
    require(cand_ids.dtype == "int32" and ids.dtype == "int32" and rows.dtype == "int32"
            and cand_values.dtype == "float32" and values.dtype == "float32",
            "beam_seed: ids and rows must be int32, values float32")
    require(cand_values.shape == (beams, count) and rows.shape == (beams,) and len(ids.shape) == 2
            and ids.shape[1] == count and values.shape == ids.shape,
            f"beam_seed: [beams, count] = {cand_ids.shape} from [N, count] = {ids.shape} by rows {rows.shape}")
    require(all(t.is_contiguous for t in (cand_ids, cand_values, ids, values)), "beam_seed: tensors must be dense")
    if beams * count:
        launch_kernel(stream, lib.get("beam_seed", MODULE), ceil_div(beams * count, SEED_THREADS), SEED_THREADS,
                      cand_ids, cand_values, ids, values, rows, beams, count)


def beam_select(lib, stream, state: int, num_active: int, parity: int, generated: int) -> None:
    """Each searching request's next running beams, parents and finished hypotheses (one block per request)."""
    if num_active:
        launch_kernel(stream, lib.get("beam_select", MODULE), num_active, SELECT_THREADS, np.uint64(state), parity,
                      generated)


def beam_fork(lib, stream, state: int, num_active: int, parity: int, generated: int, flags: int) -> None:
    """The new running beams' block tables, block holders, and the step's KV copies (one block); then every
    request's done flag and the fault flag (the state's done[0, num_requests]) into `flags`, a device address of
    pinned host memory (Cuda.device_address), which the host reads once an event after the kernel completed."""
    launch_kernel(stream, lib.get("beam_fork", MODULE), 1, FORK_THREADS, np.uint64(state), parity, generated,
                  num_active, np.uint64(flags))


def beam_metadata(lib, stream, state: int, parity: int, generated: int, num_rows: int, batch, cross=None) -> None:
    """The next decode forward's metadata into batch (a CudaBatch of batch.num_tokens >= num_rows padded decode
    rows, pack_batch's views) and cross (its cross-attention batch, encoder-decoders)."""
    rows = batch.num_tokens
    require(num_rows <= rows and batch.num_prefill == 0 and batch.num_decode == rows,
            "beam_metadata: the batch must be `rows` padded decode rows")
    views = [batch.token_ids, batch.positions, batch.slot_mapping, batch.sample_rows, batch.decode_rows,
             batch.decode_contexts, batch.decode_tables]
    cross_views = ([cross.token_ids, cross.positions, cross.slot_mapping, cross.sample_rows, cross.decode_rows,
                    cross.decode_contexts, cross.decode_tables] if cross is not None else [np.uint64(0)] * 7)
    launch_kernel(stream, lib.get("beam_metadata", MODULE), rows, METADATA_THREADS,
                  np.uint64(state), parity, generated, num_rows, rows, *views, *cross_views)
