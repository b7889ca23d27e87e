"""Launchers for cuda_kernels/activation.cu: the gated MLP activation, and ReLU."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "activation"
BLOCK = 256


def silu_mul(lib, stream, out: DeviceTensor, gate_up: DeviceTensor) -> None:
    """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:], bf16 in and out, fp32 math.
    Needs I % 8 == 0 and 16-byte aligned rows (either tensor may be strided)."""
    require(len(out.shape) == 2 and len(gate_up.shape) == 2, "silu_mul: out and gate_up must be 2-D")
    num_tokens, intermediate = out.shape
    require(gate_up.shape == (num_tokens, 2 * intermediate),
            f"silu_mul: gate_up {gate_up.shape} must be [T, 2I] = {(num_tokens, 2 * intermediate)}")
    _launch_elementwise("silu_mul", lib, stream, out, gate_up)


def relu(lib, stream, out: DeviceTensor, x: DeviceTensor) -> None:
    """out [T, I] = max(x, 0), bf16. Needs I % 8 == 0 and 16-byte aligned rows (either may be strided)."""
    require(len(x.shape) == 2 and out.shape == x.shape, f"relu: out {out.shape} and x {x.shape} must be one [T, I]")
    _launch_elementwise("relu", lib, stream, out, x)


def _launch_elementwise(name: str, lib, stream, out: DeviceTensor, x: DeviceTensor) -> None:
    """A flat grid over the 16-byte units of out [T, I], one per thread, reading the same row of x."""
    require(out.dtype == "bfloat16" and x.dtype == "bfloat16", f"{name}: out and its input must be bfloat16")
    num_tokens, width = out.shape
    require(width % 8 == 0, f"{name}: I = {width} must be a multiple of 8")
    require_aligned(out, 16, f"{name}: out")
    require_aligned(x, 16, f"{name}: input")
    units_per_row = width // 8
    if num_tokens == 0 or units_per_row == 0:
        return
    launch_kernel(stream, lib.get(name, MODULE), ceil_div(num_tokens * units_per_row, BLOCK), BLOCK, out,
                  np.int64(out.stride // 8), x, np.int64(x.stride // 8), num_tokens, units_per_row)
