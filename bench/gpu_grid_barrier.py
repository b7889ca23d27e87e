"""What a phase of a persistent kernel costs on this GPU: one CTA per SM, each phase streams a share of a weight
from HBM and ends at a grid-wide barrier (an atomic counter the CTAs spin on). The question it answers: could one
kernel run a decoder layer's ~12 dependent steps cheaper than ~12 kernels (~2 µs each at least, bench/NOTES.md)?
Needs a CUDA GPU.

For each weight size per phase (0: the barrier alone), the kernel runs 1 and 1 + ROUNDS phases; the difference
over ROUNDS is a phase's time. Phases walk through a 512 MiB buffer, so each reads from HBM, not L2. Two barriers:
`fenced` (fence, atomic add, spin, fence: session 9's 1.0 µs) and `acquire` (a release add and acquire polls, no
full fences).

Its CUDA source is persistent_kernels.py's GRID_PHASES. Run from the repository root: python3 -m bench.gpu_grid_barrier
"""

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line
from bench.persistent_kernels import GRID_PHASES

ROUNDS = 200
THREADS = 256
BUFFER_BYTES = 512 << 20
PHASE_BYTES = (0, 2 << 20, 8 << 20, 29 << 20)   # the barrier alone; out/cross linears; fc1/fc2; a whole layer


def main(argv=None) -> list[dict]:
    from cuda.core import Device, EventOptions, LaunchConfig, ObjectCode, launch

    from metrale.runtime.backend.cuda.compiler import compile_cubin
    from metrale.runtime.backend.cuda.device import CudaDevice

    print(gpu_machine_line("gpu_grid_barrier", "cuda"))
    cuda = CudaDevice()
    code = ObjectCode.from_cubin(compile_cubin("grid_barrier", GRID_PHASES, cuda.arch))
    kernels = {"fenced": code.get_kernel("phases"), "acquire": code.get_kernel("phases_acquire")}
    ctas = Device().properties.multiprocessor_count
    weights = torch.randint(0, 1 << 30, (BUFFER_BYTES // 4,), dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, device="cuda")
    stream, timing = cuda.stream, EventOptions(timing_enabled=True)

    def elapsed_ms(kernel, units: int, rounds: int) -> float:
        counter.zero_()
        torch.cuda.synchronize()
        start = stream.record(options=timing)
        launch(stream, LaunchConfig(grid=ctas, block=THREADS), kernel, np.uint64(weights.data_ptr()),
               np.int64(BUFFER_BYTES // 16), np.int64(units), np.uint64(counter.data_ptr()), np.int32(rounds),
               np.uint64(sink.data_ptr()))
        end = stream.record(options=timing)
        end.sync()
        return end - start

    print(f"{'barrier':>8} {'bytes a phase':>14} {'us a phase':>11} {'GB/s':>7}")
    rows = []
    for name, kernel in kernels.items():
        for nbytes in PHASE_BYTES:
            units = nbytes // 16
            elapsed_ms(kernel, units, 1)                               # warm-up
            one = min(elapsed_ms(kernel, units, 1) for _ in range(3))
            many = min(elapsed_ms(kernel, units, ROUNDS + 1) for _ in range(3))
            phase_us = (many - one) * 1e3 / ROUNDS
            rate = nbytes / (phase_us * 1e-6) / 1e9 if nbytes else 0.0
            print(f"{name:>8} {nbytes:>14} {phase_us:11.2f} {rate:7.0f}", flush=True)
            rows.append({"barrier": name, "bytes": nbytes, "phase_us": phase_us})
    return rows


if __name__ == "__main__":
    main()
