"""The hardware ceilings of DESIGN.md §6, measured in the same run as the figures: copy bandwidth and the bf16
GEMM rate; and the line saying what the figures ran on."""

import datetime
import os
import platform
import statistics
import subprocess

import torch

from bench.peer_llama import DeviceTimer


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting bytes read + bytes written; median of repeats."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    target.copy_(source)
    timer = DeviceTimer(device)
    for _ in range(repeats):
        started = timer.start()
        target.copy_(source)
        timer.stop(started)
    seconds = statistics.median(timer.elapsed_ms()) / 1e3
    del source, target
    return 2 * (nbytes // 2) * 2 / seconds


def gemm_rate(device: str, n: int, repeats: int = 20, sets: int = 3) -> float:
    """FLOP/s of an n x n x n bf16 torch.matmul on random inputs, rotating among `sets` input pairs; median."""
    pairs = [(torch.randn(n, n, device=device, dtype=torch.bfloat16),
              torch.randn(n, n, device=device, dtype=torch.bfloat16)) for _ in range(sets)]
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    return _matmul_rate(device, n, pairs, lambda a, b: torch.matmul(a, b, out=out), repeats)


def fp8_gemm_rate(device: str, n: int, repeats: int = 20, sets: int = 3) -> float:
    """FLOP/s of an n x n x n e4m3 matmul with a float32 scale a row of each operand and bf16 out (torch._scaled_mm:
    cuBLASLt's FP8 matmul, as the FP8 linears run), rotating among `sets` input pairs; median."""
    pairs = [(torch.randn(n, n, device=device).to(torch.float8_e4m3fn),
              torch.randn(n, n, device=device).to(torch.float8_e4m3fn).T) for _ in range(sets)]
    scale_a, scale_b = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    return _matmul_rate(device, n, pairs, lambda a, b: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                                                        out_dtype=torch.bfloat16), repeats)


def _matmul_rate(device: str, n: int, pairs: list, matmul, repeats: int) -> float:
    """2 n^3 over the median time of matmul(a, b), once over each pair first, then `repeats` times rotating."""
    for a, b in pairs:
        matmul(a, b)
    timer = DeviceTimer(device)
    for i in range(repeats):
        a, b = pairs[i % len(pairs)]
        started = timer.start()
        matmul(a, b)
        timer.stop(started)
    seconds = statistics.median(timer.elapsed_ms()) / 1e3
    pairs.clear()
    return 2 * n ** 3 / seconds


def gpu_machine_line(name: str, device: str) -> str:
    """What the figures ran on: GPU, driver, clocks, torch, CUDA, triton, CPU cores and the date."""
    if torch.device(device).type != "cuda":
        from bench.grpc_overhead import machine_line
        return machine_line(name)
    try:
        query = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        smi = f"{torch.cuda.get_device_name()} (nvidia-smi unavailable)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return (f"# {name}: {smi}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}, "
            f"python {platform.python_version()}, {os.cpu_count()} CPU cores, {date}")


def device_memory_gb(device: str) -> str:
    if torch.device(device).type != "cuda":
        return "n/a"
    free, total = torch.cuda.mem_get_info()
    return f"{(total - free) / 1e9:.1f} of {total / 1e9:.1f} GB in use"



def measure_ceilings(run, device: str, copy_mb: int, gemm_size: int) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 GEMM rate in FLOP/s) as phases of run; SystemExit where either fails."""
    bandwidth, _ = run.phase("copy bandwidth", copy_bandwidth, device, copy_mb * 10**6)
    gemm, _ = run.phase("GEMM rate", gemm_rate, device, gemm_size)
    if bandwidth is None or gemm is None:
        raise SystemExit(f"the ceilings could not be measured: {run.errors}")
    return bandwidth, gemm
