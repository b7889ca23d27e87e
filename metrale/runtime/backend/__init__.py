"""Backends implement the ops a model family is written against (ops.py): cpu.py with torch, cuda/ with
NVRTC kernels and cuBLASLt."""

import functools
from pathlib import Path

from metrale.runtime.backend.ops import Ops, RopeTable
from metrale.runtime.errors import FailedPrecondition


@functools.cache
def cuda_available() -> bool:
    """A CUDA driver and at least one device, asked of the driver itself (no torch), once per process: without
    a driver library, repeated driver calls fail differently each time."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return False
    try:
        (status,) = driver.cuInit(0)
        if status != driver.CUresult.CUDA_SUCCESS:
            return False
        status, count = driver.cuDeviceGetCount()
        return status == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # no driver library at all
        return False


def create_backend(device: str, dtype: str, cache_dir: Path, programmatic_launch: bool = True) -> Ops:
    """device: 'auto' (CUDA where a GPU is present), 'cpu' or 'cuda'; programmatic_launch: CUDA's PDL on Hopper."""
    if device == "cuda" or (device == "auto" and cuda_available()):
        if not cuda_available():
            raise FailedPrecondition("--device cuda, but no CUDA device is visible")
        from metrale.runtime.backend.cuda.backend import CudaBackend
        return CudaBackend(cache_dir / "kernels", dtype, programmatic_launch)
    from metrale.runtime.backend.cpu import CpuBackend
    return CpuBackend(dtype)


__all__ = ["Ops", "RopeTable", "create_backend", "cuda_available"]
