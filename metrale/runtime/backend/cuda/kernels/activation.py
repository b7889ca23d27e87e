"""Launchers for cuda_kernels/activation.cu: the gated MLP activation, and ReLU."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "activation"
BLOCK = 256


def silu_mul(lib, stream, out: DeviceTensor, gate_up: DeviceTensor) -> None:
    """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:], bf16 in and out, fp32 math.
    Needs I % 8 == 0 and 16-byte aligned rows (either tensor may be strided)."""
    require(out.dtype == "bfloat16" and gate_up.dtype == "bfloat16", "silu_mul: out and gate_up must be bfloat16")
    require(len(out.shape) == 2 and len(gate_up.shape) == 2, "silu_mul: out and gate_up must be 2-D")
    num_tokens, intermediate = out.shape
    require(gate_up.shape == (num_tokens, 2 * intermediate),
            f"silu_mul: gate_up {gate_up.shape} must be [T, 2I] = {(num_tokens, 2 * intermediate)}")
    require(intermediate % 8 == 0, f"silu_mul: I = {intermediate} must be a multiple of 8")
    require_aligned(out, 16, "silu_mul: out")
    require_aligned(gate_up, 16, "silu_mul: gate_up")
    units_per_row = intermediate // 8
    if num_tokens == 0 or units_per_row == 0:
        return
    kernel = lib.get("silu_mul", MODULE)
    launch_kernel(stream, kernel, ceil_div(num_tokens * units_per_row, BLOCK), BLOCK, out, np.int64(out.stride // 8),
                  gate_up, np.int64(gate_up.stride // 8), num_tokens, units_per_row)


def relu(lib, stream, out: DeviceTensor, x: DeviceTensor) -> None:
    """out [T, I] = max(x, 0), bf16. Needs I % 8 == 0 and 16-byte aligned rows (either may be strided)."""
    require(out.dtype == "bfloat16" and x.dtype == "bfloat16", "relu: out and x must be bfloat16")
    require(len(x.shape) == 2 and out.shape == x.shape, f"relu: out {out.shape} and x {x.shape} must be one [T, I]")
    num_tokens, width = x.shape
    require(width % 8 == 0, f"relu: I = {width} must be a multiple of 8")
    require_aligned(out, 16, "relu: out")
    require_aligned(x, 16, "relu: x")
    units_per_row = width // 8
    if num_tokens == 0 or units_per_row == 0:
        return
    kernel = lib.get("relu", MODULE)
    launch_kernel(stream, kernel, ceil_div(num_tokens * units_per_row, BLOCK), BLOCK, out, np.int64(out.stride // 8),
                  x, np.int64(x.stride // 8), num_tokens, units_per_row)
