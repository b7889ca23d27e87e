"""Backends implement the ops a model family is written against (ops.py): cpu.py with torch, cuda later."""

from metrale.runtime.backend.ops import Ops, RopeTable


def create_backend(device: str, dtype: str) -> Ops:
    """device is 'auto', 'cpu' or 'cuda'; only the CPU backend exists so far."""
    from metrale.runtime.backend.cpu import CpuBackend
    from metrale.runtime.errors import FailedPrecondition

    if device == "cuda":
        raise FailedPrecondition("the CUDA backend is not built yet; use --device cpu")
    return CpuBackend(dtype)


__all__ = ["Ops", "RopeTable", "create_backend"]
