"""Kernel launch with checked arguments: every launcher goes through launch_kernel."""

import numpy as np
from cuda.core import LaunchConfig, launch

from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument


# A grid's y and z extents at most.
MAX_GRID_YZ = 65535


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def kernel_arg(value):
    """DeviceTensor -> its pointer (uint64); int -> int32; float -> float32; numpy scalars pass as they are."""
    if isinstance(value, DeviceTensor):
        return np.uint64(value.ptr)
    if isinstance(value, bool):
        return np.int32(int(value))
    if isinstance(value, int):
        if not -(1 << 31) <= value < (1 << 31):
            raise InvalidArgument(f"kernel int argument {value} does not fit in int32; pass np.int64 explicitly")
        return np.int32(value)
    if isinstance(value, float):
        return np.float32(value)
    if isinstance(value, np.generic):
        return value
    raise InvalidArgument(f"cannot pass {type(value).__name__} to a kernel")


# Programmatic dependent launch: on sm_90 and later every kernel is launched with programmatic stream
# serialization, so it can start while the kernel before it drains (each kernel begins with
# wait_for_previous_kernel(), common.cuh). KernelLibrary turns it on for the device it loads kernels for.
_programmatic = False


def use_programmatic_launch(enabled: bool) -> None:
    global _programmatic
    _programmatic = enabled


def programmatic_launch() -> bool:
    return _programmatic


def launch_kernel(stream, kernel, grid, block, *args, shmem: int = 0) -> None:
    """grid/block: int or tuple; shmem: dynamic shared memory bytes."""
    config = LaunchConfig(grid=grid, block=block, shmem_size=shmem, programmatic_stream_serialization=_programmatic)
    launch(stream, config, kernel, *(kernel_arg(a) for a in args))


def require(condition: bool, message: str) -> None:
    """Launcher argument checks: shapes, dtypes, alignment. Raises InvalidArgument, never asserts."""
    if not condition:
        raise InvalidArgument(message)


def require_aligned(tensor: DeviceTensor, num_bytes: int, name: str) -> None:
    require(tensor.ptr % num_bytes == 0 and (tensor.stride * tensor.itemsize) % num_bytes == 0,
            f"{name} must be {num_bytes}-byte aligned (pointer and row stride)")
