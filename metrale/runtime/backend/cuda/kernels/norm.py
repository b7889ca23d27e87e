"""Launchers for cuda_kernels/norm.cu: RMSNorm and LayerNorm with an optional fused residual add, and per-head
RMSNorm."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "norm"
MAX_BLOCK = 1024
RMS_NORM_MAX_UNITS = 4         # as in norm.cu: 16-byte units per thread
MAX_HIDDEN = RMS_NORM_MAX_UNITS * 8 * MAX_BLOCK
HEAD_NORM_WARPS = 4            # as in norm.cu
MAX_HEAD_DIM = 256
MAX_PARTIALS = 8               # as in norm.cu
NULL = np.uint64(0)


def rms_norm(lib, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, eps: float,
             residual: DeviceTensor | None = None, residual_out: DeviceTensor | None = None) -> None:
    """out [T, H] = rms_norm(x [+ residual]) * weight [H], all bf16.
    With residual, residual_out = bf16(x + residual) (residual_out is required; it may be residual itself);
    without, residual_out (if given) = x. Needs H % 8 == 0, H <= 32768, 16-byte aligned rows."""
    _launch_row_norm("rms_norm", lib, stream, out, x, (weight,), eps, residual, residual_out)


def layer_norm(lib, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor,
               eps: float, residual: DeviceTensor | None = None, residual_out: DeviceTensor | None = None) -> None:
    """out [T, H] = layer_norm(x [+ residual]) * weight [H] + bias [H], all bf16, fp32 statistics; the residual
    add and the requirements are rms_norm's."""
    _launch_row_norm("layer_norm", lib, stream, out, x, (weight, bias), eps, residual, residual_out)


def layer_norm_gathered(lib, stream, out: DeviceTensor, residual_out: DeviceTensor, x_table: DeviceTensor,
                        x_rows: DeviceTensor, residual_table: DeviceTensor, residual_rows: DeviceTensor,
                        weight: DeviceTensor, bias: DeviceTensor, eps: float) -> None:
    """layer_norm over rows it gathers (an embedding layer's token and position lookups and its first norm in one
    launch): residual_out [T, H] = bf16(x_table [V, H] [x_rows [T]] + residual_table [P, H] [residual_rows [T]]),
    out [T, H] = layer_norm(residual_out) * weight + bias, as embedding and gather_rows then layer_norm give. An
    index outside its table reads a zero row. Tables bf16 with 16-byte aligned rows (they may be column slices)."""
    name = "layer_norm_gathered"
    require(len(out.shape) == 2, f"{name}: out must be [T, H], not {out.shape}")
    num_tokens, hidden = out.shape
    for label, table in (("x_table", x_table), ("residual_table", residual_table)):
        require(table.dtype == "bfloat16" and len(table.shape) == 2 and table.shape[1] == hidden,
                f"{name}: {label} must be [rows, {hidden}] bfloat16, not {table.shape} {table.dtype}")
        require_aligned(table, 16, f"{name}: {label}")
    for label, rows in (("x_rows", x_rows), ("residual_rows", residual_rows)):
        require(rows.dtype == "int32" and rows.shape == (num_tokens,), f"{name}: {label} must be [{num_tokens}] int32")
    _check_row_norm(name, out, (weight, bias), None, residual_out)
    if num_tokens == 0:
        return
    launch_kernel(stream, lib.get(name, MODULE), num_tokens, _block(name, lib, hidden), out, _stride(out),
                  residual_out, _stride(residual_out), x_table, _stride(x_table), x_rows, np.int32(x_table.shape[0]),
                  residual_table, _stride(residual_table), residual_rows, np.int32(residual_table.shape[0]), weight,
                  bias, np.int32(hidden), float(eps))


def layer_norm_partials(lib, stream, out: DeviceTensor, partials: DeviceTensor, splits: int,
                        linear_bias: DeviceTensor | None, weight: DeviceTensor, bias: DeviceTensor, eps: float,
                        residual: DeviceTensor, residual_out: DeviceTensor) -> None:
    """layer_norm over residual + a linear's output given as split-K partials (CublasLt.linear with splits):
    residual_out [T, H] = bf16(residual + bf16(partial_0 + .. + partial_{splits - 1} + linear_bias)), out [T, H] =
    layer_norm(residual_out) * weight + bias. partials [splits * T, H] float32, contiguous; linear_bias [H] bf16 or
    None; the rest as layer_norm's (residual_out may be residual itself)."""
    require(len(out.shape) == 2, f"layer_norm_partials: out must be [T, H], not {out.shape}")
    require(residual is not None and residual_out is not None, "layer_norm_partials: needs residual and residual_out")
    num_tokens, hidden = out.shape
    require(1 <= splits <= MAX_PARTIALS, f"layer_norm_partials: {splits} partials, not 1 to {MAX_PARTIALS}")
    require(partials.dtype == "float32" and partials.is_contiguous
            and partials.shape == (splits * num_tokens, hidden),
            f"layer_norm_partials: partials must be [{splits} * {num_tokens}, {hidden}] float32 contiguous, not "
            f"{partials.shape} {partials.dtype}")
    require(partials.ptr % 16 == 0, "layer_norm_partials: partials must be 16-byte aligned")
    require(linear_bias is None or (linear_bias.dtype == "bfloat16" and linear_bias.shape == (hidden,)
                                    and linear_bias.ptr % 16 == 0),
            f"layer_norm_partials: the linear's bias must be [{hidden}] bfloat16, 16-byte aligned")
    _check_row_norm("layer_norm_partials", out, (weight, bias), residual, residual_out)
    if num_tokens == 0:
        return
    block = _block("layer_norm_partials", lib, hidden)
    launch_kernel(stream, lib.get("layer_norm_partials", MODULE), num_tokens, block, out, _stride(out),
                  residual_out, _stride(residual_out), partials, np.int32(num_tokens), np.int32(splits),
                  _pointer(linear_bias), residual, _stride(residual), weight, bias, np.int32(hidden), float(eps))


def _launch_row_norm(name: str, lib, stream, out, x, params: tuple, eps, residual, residual_out) -> None:
    """One block per row of x; params: the [H] bf16 vectors the kernel takes after its row pointers."""
    require(len(x.shape) == 2, f"{name}: x must be [T, H], not {x.shape}")
    require(residual is None or residual_out is not None, f"{name}: a residual add needs residual_out")
    _check_row_norm(name, x, params, residual, residual_out, out)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    kernel = lib.get(name, MODULE)
    launch_kernel(stream, kernel, num_tokens, _block(name, lib, hidden), out, _stride(out), _pointer(residual_out),
                  _stride(residual_out), x, _stride(x), _pointer(residual), _stride(residual), *params, hidden,
                  float(eps))


def _check_row_norm(name: str, x: DeviceTensor, params: tuple, residual, residual_out, out=None) -> None:
    """The [T, H] bf16 rows (x's shape; each 16-byte aligned) and the [H] bf16 params a row norm takes."""
    hidden = x.shape[1]
    rows = {"out": out if out is not None else x, "x": x, "residual": residual, "residual_out": residual_out}
    for label, tensor in rows.items():
        if tensor is None:
            continue
        require(tensor.dtype == "bfloat16", f"{name}: {label} must be bfloat16, not {tensor.dtype}")
        require(tensor.shape == x.shape, f"{name}: {label} {tensor.shape} must have x's shape {x.shape}")
        require_aligned(tensor, 16, f"{name}: {label}")
    for param in params:
        require(param.dtype == "bfloat16" and param.shape == (hidden,),
                f"{name}: weight and bias must be [{hidden}] bfloat16")
        require(param.ptr % 16 == 0, f"{name}: weight and bias must be 16-byte aligned")
    require(hidden % 8 == 0 and 0 < hidden <= MAX_HIDDEN, f"{name}: hidden {hidden} must be a multiple of 8, "
                                                          f"at most {MAX_HIDDEN}")


def _block(name: str, lib, hidden: int) -> int:
    """One 16-byte unit per thread up to hidden 8192, then up to RMS_NORM_MAX_UNITS per thread; fewer threads where
    the kernel's registers allow fewer (layer_norm_partials: ~500), with more units each."""
    limit = min(MAX_BLOCK, lib.max_block(name, MODULE))
    block = min(limit, 32 * ceil_div(hidden // 8, 32))
    require(hidden <= RMS_NORM_MAX_UNITS * 8 * block,
            f"{name}: hidden {hidden} is more than its {block}-thread blocks hold ({RMS_NORM_MAX_UNITS * 8 * block})")
    return block


def head_rms_norm(lib, stream, x: DeviceTensor, weight: DeviceTensor, eps: float, head_dim: int) -> None:
    """In place: each head_dim slice of x [T, heads * head_dim] (bf16, may be a column slice of qkv)
    = rms_norm(slice) * weight [head_dim]. Needs head_dim even and <= 256, 4-byte aligned rows."""
    require(x.dtype == "bfloat16" and len(x.shape) == 2, "head_rms_norm: x must be [T, heads * head_dim] bfloat16")
    require(head_dim > 0 and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM,
            f"head_rms_norm: head_dim {head_dim} must be even and at most {MAX_HEAD_DIM}")
    require(x.shape[1] % head_dim == 0, f"head_rms_norm: x width {x.shape[1]} is not a multiple of {head_dim}")
    require(weight.dtype == "bfloat16" and weight.shape == (head_dim,),
            f"head_rms_norm: weight must be [{head_dim}] bfloat16")
    require_aligned(x, 4, "head_rms_norm: x")
    require(weight.ptr % 4 == 0, "head_rms_norm: weight must be 4-byte aligned")
    num_tokens, num_heads = x.shape[0], x.shape[1] // head_dim
    if num_tokens == 0 or num_heads == 0:
        return
    kernel = lib.get("head_rms_norm", MODULE)
    launch_kernel(stream, kernel, ceil_div(num_tokens * num_heads, HEAD_NORM_WARPS), 32 * HEAD_NORM_WARPS,
                  x, _stride(x), weight, num_tokens, num_heads, head_dim, float(eps))


def _pointer(tensor: DeviceTensor | None):
    return NULL if tensor is None else tensor


def _stride(tensor: DeviceTensor | None):
    return np.int64(0 if tensor is None else tensor.stride)
