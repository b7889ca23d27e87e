"""Launchers for cuda_kernels/activation.cu: the gated MLP activation, ReLU and its square, and the elementwise add,
x * silu(gate) of the SSM hybrids and x * sigmoid(gate) of Hy4's gated attention."""

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
    _launch_elementwise("relu", lib, stream, out, x, 0)


def relu_squared(lib, stream, out: DeviceTensor, x: DeviceTensor) -> None:
    """out [T, I] = max(x, 0) ** 2, bf16; as relu."""
    require(len(x.shape) == 2 and out.shape == x.shape,
            f"relu_squared: out {out.shape} and x {x.shape} must be one [T, I]")
    _launch_elementwise("relu", lib, stream, out, x, 1)


def add(lib, stream, out: DeviceTensor, x: DeviceTensor, y: DeviceTensor) -> None:
    """out [T, I] = x + y, bf16, rounded once."""
    _launch_binary(0, lib, stream, out, x, y)


def mul_silu(lib, stream, out: DeviceTensor, x: DeviceTensor, gate: DeviceTensor) -> None:
    """out [T, I] = x * silu(gate), bf16, fp32 math rounded once."""
    _launch_binary(1, lib, stream, out, x, gate)


def mul_sigmoid(lib, stream, out: DeviceTensor, x: DeviceTensor, gate: DeviceTensor) -> None:
    """out [T, I] = x * sigmoid(gate), bf16, fp32 math rounded once."""
    _launch_binary(2, lib, stream, out, x, gate)


def _launch_binary(op: int, lib, stream, out: DeviceTensor, x: DeviceTensor, y: DeviceTensor) -> None:
    require(len(x.shape) == 2 and out.shape == x.shape == y.shape,
            f"binary: out {out.shape}, x {x.shape} and y {y.shape} must be one [T, I]")
    require(all(t.dtype == "bfloat16" for t in (out, x, y)), "binary: out, x and y must be bfloat16")
    num_tokens, width = out.shape
    require(width % 8 == 0, f"binary: I = {width} must be a multiple of 8")
    for tensor, name in ((out, "out"), (x, "x"), (y, "y")):
        require_aligned(tensor, 16, f"binary: {name}")
    units_per_row = width // 8
    if num_tokens == 0:
        return
    launch_kernel(stream, lib.get("binary", MODULE), ceil_div(num_tokens * units_per_row, BLOCK), BLOCK, out,
                  np.int64(out.stride // 8), x, np.int64(x.stride // 8), y, np.int64(y.stride // 8), num_tokens,
                  units_per_row, op)


def _launch_elementwise(name: str, lib, stream, out: DeviceTensor, x: DeviceTensor, *flags: int) -> None:
    """A flat grid over the 16-byte units of out [T, I], one per thread, reading the same row of x; flags: the
    kernel's arguments after those (relu's square)."""
    require(out.dtype == "bfloat16" and x.dtype == "bfloat16", f"{name}: out and its input must be bfloat16")
    num_tokens, width = out.shape
    require(width % 8 == 0, f"{name}: I = {width} must be a multiple of 8")
    require_aligned(out, 16, f"{name}: out")
    require_aligned(x, 16, f"{name}: input")
    units_per_row = width // 8
    if num_tokens == 0 or units_per_row == 0:
        return
    launch_kernel(stream, lib.get(name, MODULE), ceil_div(num_tokens * units_per_row, BLOCK), BLOCK, out,
                  np.int64(out.stride // 8), x, np.int64(x.stride // 8), num_tokens, units_per_row, *flags)
