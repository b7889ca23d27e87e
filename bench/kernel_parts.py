"""Device time of some work by part, from the kernels CUPTI saw run (through torch.profiler): each kernel counted
under the first part one of whose keys is in its name, the rest as "other", the costliest of those named."""

from typing import Callable, Iterable

import torch

# cuBLASLt's GEMM kernels go by several names.
GEMM_KEYS = ("gemm", "nvjet", "cutlass", "xmma", "splitk", "linear_partials")
OTHERS_NAMED = 3            # the unmatched kernels that get a part of their own ("other: NAME"), costliest first
NAME_CHARS = 48


def device_ms_by_part(work: Callable[[], object], parts: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, float]:
    """Runs work() once under the profiler; tally() of the CUDA kernels it ran."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return tally(((e.name(), e.duration_ns() / 1e6) for e in prof.profiler.kineto_results.events()
                  if e.device_type() == torch.autograd.DeviceType.CUDA), parts)


def tally(kernels: Iterable[tuple[str, float]], parts: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, float]:
    """ms by part name (lower-case substrings of kernel names) of (kernel name, ms) pairs, then the OTHERS_NAMED
    costliest kernels no part names, each as "other: NAME", and the rest of them as "other"."""
    totals = {name: 0.0 for name, _ in parts}
    others: dict[str, float] = {}
    for name, ms in kernels:
        part = next((part for part, keys in parts if any(key in name.lower() for key in keys)), None)
        if part is None:
            others[name[:NAME_CHARS]] = others.get(name[:NAME_CHARS], 0.0) + ms
        else:
            totals[part] += ms
    named = sorted(others, key=others.get, reverse=True)[:OTHERS_NAMED]
    return (totals | {f"other: {name}": others[name] for name in named}
            | {"other": sum(ms for name, ms in others.items() if name not in named)})


def format_parts(what: str, totals: dict[str, float]) -> str:
    """A table's comment line: the device ms of `what` ("one prefill") by part, and each part's share."""
    busy = sum(totals.values()) or 1.0
    return f"# the kernels of {what} (CUPTI, device ms): " + ", ".join(
        f"{name} {ms:.2f} ({100 * ms / busy:.0f}%)" for name, ms in totals.items())
