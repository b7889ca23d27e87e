"""The CPU backend: layer math and runner in plain torch."""

from metrale.runtime.backend.cpu.layer_math import DTYPES, CpuLayerMath
from metrale.runtime.backend.cpu.runner import CpuRunner


def create_cpu_backend(dtype: str, dequantize: bool = False, group=None) -> tuple[CpuLayerMath, CpuRunner]:
    math = CpuLayerMath(dtype, dequantize, group)
    return math, CpuRunner(math.dtype)


__all__ = ["DTYPES", "CpuLayerMath", "CpuRunner", "create_cpu_backend"]
