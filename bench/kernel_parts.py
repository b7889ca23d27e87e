"""Device time of some work by part, from the kernels CUPTI saw run (through torch.profiler): each kernel counted
under the first part one of whose keys is in its name, the rest as "other"."""

from typing import Callable

import torch

# cuBLASLt's GEMM kernels go by several names.
GEMM_KEYS = ("gemm", "nvjet", "cutlass", "xmma", "splitk", "linear_partials")


def device_ms_by_part(work: Callable[[], object], parts: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, float]:
    """Runs work() once under the profiler; device ms by part name (lower-case substrings of kernel names)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    totals = {name: 0.0 for name, _ in parts} | {"other": 0.0}
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name().lower()
        part = next((part for part, keys in parts if any(key in name for key in keys)), "other")
        totals[part] += event.duration_ns() / 1e6
    return totals


def format_parts(what: str, totals: dict[str, float]) -> str:
    """A table's comment line: the device ms of `what` ("one prefill") by part, and each part's share."""
    busy = sum(totals.values()) or 1.0
    return f"# the kernels of {what} (CUPTI, device ms): " + ", ".join(
        f"{name} {ms:.2f} ({100 * ms / busy:.0f}%)" for name, ms in totals.items())
