"""Backends implement the two interfaces: the layer math models are written against (layer_math.py) and the runner
the engine drives (runner.py). cpu/ with torch, cuda/ with NVRTC kernels and cuBLASLt."""

import functools
from pathlib import Path
from typing import NamedTuple

from metrale.runtime.backend.layer_math import LayerMath
from metrale.runtime.backend.runner import Runner
from metrale.runtime.errors import FailedPrecondition


class Backend(NamedTuple):
    math: LayerMath
    runner: Runner


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


def runs_on_cuda(device: str) -> bool:
    """Whether create_backend(device) makes the CUDA backend: 'cuda', or 'auto' where a GPU is present."""
    return device == "cuda" or (device == "auto" and cuda_available())


def create_backend(device: str, dtype: str, cache_dir: Path, programmatic_launch: bool = True,
                   dequantize: bool = False, group=None) -> Backend:
    """device: 'auto' (CUDA where a GPU is present), 'cpu' or 'cuda'; programmatic_launch: CUDA's PDL on Hopper;
    dequantize: the CPU backend dequantizes GGUF block weights at upload instead of multiplying them as they are
    (the CUDA backend always uploads them dequantized, in bfloat16); group: a tensor-parallel worker's ranks
    (parallel/group.py), None for one device: on CUDA, rank r runs on the r-th visible GPU."""
    if runs_on_cuda(device):
        if not cuda_available():
            raise FailedPrecondition("--device cuda, but no CUDA device is visible")
        from metrale.runtime.backend.cuda import create_cuda_backend
        return Backend(*create_cuda_backend(cache_dir, dtype, programmatic_launch, group))
    from metrale.runtime.backend.cpu import create_cpu_backend
    return Backend(*create_cpu_backend(dtype, dequantize, group))


__all__ = ["Backend", "LayerMath", "Runner", "create_backend", "cuda_available", "runs_on_cuda"]
