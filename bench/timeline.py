"""One call's host phases and device activity on one clock (torch.profiler: CUPTI for the device, record_function
ranges for the host functions named), in time order: where the device waits for the host.

Each named function is wrapped in a record_function range for the profiled call only. Device activities closer
than `merge_us` to the one before are printed as one run (count, busy time, first and last names); the gap
before each run is the device's idle time, and the host ranges that start in it say what the host was doing.
"""

import contextlib
import statistics
import time

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile


def _label(owner, name: str) -> str:
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"


@contextlib.contextmanager
def _wrapped(marks: list[tuple[object, str]], wrap):
    """Each (owner, attribute) of marks replaced by wrap(function, label) for the block."""
    patches = []
    for owner, name in marks:
        original = getattr(owner, name)
        patches.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, wrap(original, _label(owner, name)))
    try:
        yield
    finally:
        for owner, name, original, own in reversed(patches):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _ranged(function, label: str):
    def wrapped(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)
    return wrapped


def host_costs(call, marks: list[tuple[object, str]], reps: int) -> str:
    """call() reps times with each of marks timed by the host's clock (no profiler: its recording of every torch
    op would slow torch-heavy functions): the median µs a call of each function takes, with what it calls, and
    how often a call runs it."""
    spent: dict[str, list[float]] = {}

    def timed(function, label):
        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent.setdefault(label, []).append(time.perf_counter() - started)
        return wrapped

    with _wrapped(marks, timed):
        for _ in range(reps):
            call()
    lines = [f"{'median us':>10} {'calls':>6} {'us a call':>10}  function (host clock, {reps} calls)"]
    for label, times in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
        median = statistics.median(times) * 1e6
        lines.append(f"{median:10.1f} {len(times) // reps:6d} {median * len(times) / reps:10.1f}  {label}")
    return "\n".join(lines)


def timeline(call, marks: list[tuple[object, str]], rows: int, merge_us: float = 2.0) -> str:
    """call() once, profiled with each (owner, attribute) of marks timed as a host range; the first `rows` lines
    of the merged timeline, offsets in µs from the first event. The profiler records every torch op as well, which
    slows torch-heavy host functions (host_costs() gives their own times)."""
    with _wrapped(marks, _ranged):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    labels = {_label(o, n) for o, n in marks}
    host, device = [], []
    for event in prof.profiler.kineto_results.events():
        start, end = event.start_ns(), event.start_ns() + event.duration_ns()
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            device.append((start, end, event.name()))
        elif event.name() in labels:
            host.append((start, end, event.name()))
    return format_timeline(sorted(host), _runs(sorted(device), merge_us * 1e3), rows)


def _runs(device: list[tuple[int, int, str]], merge_ns: float) -> list[list]:
    """Device activities as runs: [start, end, count, busy ns, first name, last name, idle ns before]."""
    runs, covered = [], None
    for start, end, name in device:
        if runs and start - covered <= merge_ns:
            run = runs[-1]
            run[1], run[2], run[3], run[5] = max(run[1], end), run[2] + 1, run[3] + end - start, name
        else:
            runs.append([start, end, 1, end - start, name, name, 0 if covered is None else start - covered])
        covered = end if covered is None else max(covered, end)
    return runs


def format_timeline(host: list, runs: list, rows: int) -> str:
    if not host and not runs:
        return "(no events)"
    origin = min([h[0] for h in host] + [r[0] for r in runs])
    events = [(s, 0, f"host   {(e - s) / 1e3:9.1f} us  {name}") for s, e, name in host]
    for start, end, count, busy, first, last, idle in runs:
        names = first[:50] if count == 1 else f"{first[:40]} .. {last[:40]}"
        events.append((start, 1, f"device {(end - start) / 1e3:9.1f} us  idle before {idle / 1e3:7.1f} us, "
                                  f"{count} activities, busy {busy / 1e3:.1f} us: {names}"))
    events.sort()
    lines = [f"{'at us':>9}  what"]
    lines += [f"{(s - origin) / 1e3:9.1f}  {text}" for s, _, text in events[:rows]]
    if len(events) > rows:
        lines.append(f"... {len(events) - rows} more")
    idle = sum(r[6] for r in runs)
    lines.append(f"device idle between activities: {idle / 1e3:.1f} us in all; "
                 f"call {(max([h[1] for h in host] + [r[1] for r in runs]) - origin) / 1e3:.1f} us")
    return "\n".join(lines)
