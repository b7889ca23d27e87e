"""Launchers for cuda_kernels/embedding.cu: token embedding lookup, row gathers, M2M100's decode position ids."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument

MODULE = "embedding"
BLOCK = 256
MAX_GRID_Y = 65535


def embedding(lib, stream, out: DeviceTensor, table: DeviceTensor, token_ids: DeviceTensor) -> None:
    """out [T, H] = table [V, H] [token_ids [T]], bf16. An id outside [0, V) gives a zero row."""
    require(table.dtype == "bfloat16" and out.dtype == "bfloat16", "embedding: out and table must be bfloat16")
    require(token_ids.dtype == "int32" and len(token_ids.shape) == 1, "embedding: token_ids must be [T] int32")
    require(len(table.shape) == 2 and len(out.shape) == 2, "embedding: out and table must be 2-D")
    require(out.shape == (token_ids.shape[0], table.shape[1]),
            f"embedding: out {out.shape} must be [T, H] = {(token_ids.shape[0], table.shape[1])}")
    # The lookup is a row gather of the table.
    gather_rows(lib, stream, out, table, token_ids)


def gather_rows(lib, stream, out: DeviceTensor, x: DeviceTensor, rows: DeviceTensor) -> None:
    """out [N, C] = x [T, C] [rows [N]]; bf16 or fp32, x and out may be column slices.
    A row index outside [0, T) gives a zero row."""
    require(x.dtype in ("bfloat16", "float32"), f"gather_rows: x must be bfloat16 or float32, not {x.dtype}")
    require(out.dtype == x.dtype, f"gather_rows: out is {out.dtype}, x is {x.dtype}")
    require(rows.dtype == "int32" and len(rows.shape) == 1, "gather_rows: rows must be [N] int32")
    require(len(x.shape) == 2 and len(out.shape) == 2, "gather_rows: out and x must be 2-D")
    require(out.shape == (rows.shape[0], x.shape[1]),
            f"gather_rows: out {out.shape} must be [N, C] = {(rows.shape[0], x.shape[1])}")
    require(rows.ptr % 4 == 0, "gather_rows: rows must be 4-byte aligned")
    num_rows, columns = out.shape
    if num_rows == 0 or columns == 0:
        return
    row_bytes = columns * x.itemsize
    unit = _copy_unit((out, x), row_bytes, (16, 4, 2))
    kernel = lib.get(f"gather_rows_{unit}b", MODULE)
    _launch_row_copy(stream, kernel, out, x, rows, x.shape[0], row_bytes, unit)


def _copy_unit(tensors: tuple[DeviceTensor, ...], row_bytes: int, units: tuple[int, ...]) -> int:
    """The widest unit (bytes) dividing the row length and every pointer and row stride."""
    for unit in units:
        if row_bytes % unit == 0 and all(t.ptr % unit == 0 and t.stride * t.itemsize % unit == 0 for t in tensors):
            return unit
    raise InvalidArgument(f"row copy: pointers and row strides must be at least {units[-1]}-byte aligned")


def _launch_row_copy(stream, kernel, out: DeviceTensor, source: DeviceTensor, indices: DeviceTensor,
                     num_source_rows: int, row_bytes: int, unit: int) -> None:
    # grid (rows, column chunks); each block strides over its row, so the chunk count is capped.
    units_per_row = row_bytes // unit
    chunks = min(ceil_div(units_per_row, BLOCK), MAX_GRID_Y)
    out_stride = out.stride * out.itemsize // unit
    source_stride = source.stride * source.itemsize // unit
    launch_kernel(stream, kernel, (out.shape[0], chunks), BLOCK, out, np.int64(out_stride), source,
                  np.int64(source_stride), indices, num_source_rows, units_per_row)


def fairseq_position_ids(lib, stream, ids: DeviceTensor, token_ids: DeviceTensor, positions: DeviceTensor,
                         padding_idx: int) -> None:
    """ids [T] int32 = padding_idx where token_ids [T] is padding_idx, else positions [T] + 1 + padding_idx:
    M2M100's position ids of one-token segments, or of segments without a padding id
    (LayerMath.fairseq_position_ids)."""
    for name, tensor in (("ids", ids), ("token_ids", token_ids), ("positions", positions)):
        require(tensor.dtype == "int32" and tensor.shape == token_ids.shape and len(tensor.shape) == 1,
                f"fairseq_position_ids: {name} must be [T] int32 like token_ids, not {tensor.shape} {tensor.dtype}")
    if token_ids.shape[0] == 0:
        return
    kernel = lib.get("fairseq_position_ids", MODULE)
    launch_kernel(stream, kernel, ceil_div(token_ids.shape[0], BLOCK), BLOCK, ids, token_ids, positions,
                  token_ids.shape[0], padding_idx)
