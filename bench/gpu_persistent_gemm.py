"""What a linear costs as a phase of a persistent kernel, at a 16-request beam step's 64 rows: the question before a
persistent decoder layer (bench/NOTES.md, sessions 9 and 14). Needs a CUDA GPU (sm_80 or later).

One CTA per SM (128 of them), each phase a linear's split-K share: CTA (n tile, K slice) multiplies x's K slice
[64, k_slice] by its weight tile [n_tile, k_slice] on tensor cores (mma.sync m16n8k16, bf16 in, fp32 out) and
writes the fp32 partial [64, n_tile] of its slice (the next phase would sum the slices, as layer_norm_partials
sums cuBLASLt's). Then a grid-wide barrier, as between a layer's dependent steps. With `prefetch` the next phase's
weight tile is copied into shared memory (cp.async) while this phase runs, so a phase waits only for x's slice,
which in a real layer the phase before writes; without it the weight comes after the barrier with x. Each
phase's weight is the next copy of it in a pool over 512 MiB, so every phase reads it from HBM, as a step does.

A phase's time is (time of 1 + ROUNDS phases - time of 1) / ROUNDS; against it, cuBLASLt's per-launch times in
the step's kernel table (session 14, PDL off): the 1024 x 1024 linears as 4 K-slice partials 3.41 us, qkv 5.46,
fc1 5.81, fc2 as partials 5.47, each after ~0.5 us of idle device (cuBLASLt does not take part in PDL).

Its CUDA source is persistent_kernels.py's GEMM_PHASES. Run from the repository root:
python3 -m bench.gpu_persistent_gemm
"""

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line
from bench.persistent_kernels import (CTAS, GEMM_PHASES, PHASE_DTYPE, ROWS, SHARED_BYTES, THREADS, Split,
                                      persistent_kernel)

ROUNDS = 120
POOL_BYTES = 512 << 20
# NLLB-200-600M's decoder linears (cuBLASLt's per-launch time in the step, us, for the table).
SPLITS = [Split("o / cross q 1024 x 1024", 1024, 1024, 64, 128), Split("o / cross q 1024 x 1024", 1024, 1024, 32, 256),
          Split("qkv 3072 x 1024", 3072, 1024, 96, 256), Split("qkv 3072 x 1024", 3072, 1024, 192, 128),
          Split("fc1 4096 x 1024", 4096, 1024, 128, 256), Split("fc1 4096 x 1024", 4096, 1024, 256, 128),
          Split("fc2 1024 x 4096", 1024, 4096, 64, 512), Split("fc2 1024 x 4096", 1024, 4096, 128, 256)]
CUBLAS_US = {"o / cross q 1024 x 1024": 3.41, "qkv 3072 x 1024": 5.46, "fc1 4096 x 1024": 5.81,
             "fc2 1024 x 4096": 5.47}
# A decoder layer's linears in order, as one sequence of phases.
LAYER = [SPLITS[2], SPLITS[0], SPLITS[0], SPLITS[0], SPLITS[4], SPLITS[6]]


@dataclass
class Row:
    name: str
    n_tile: int
    k_slice: int
    prefetch_us: float
    plain_us: float
    relative_error: float


def main(argv=None) -> list[dict]:
    from cuda.core import EventOptions, LaunchConfig, launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for split in SPLITS:
        split.check()

    print(gpu_machine_line("gpu_persistent_gemm", "cuda"))
    cuda, kernel = persistent_kernel("persistent_gemm", GEMM_PHASES, "gemm_phases")
    stream, timing = cuda.stream, EventOptions(timing_enabled=True)
    x = (torch.randn(ROWS, 4096, device="cuda") * 0.5).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    pools, partials = {}, {}

    def pool(split: Split) -> torch.Tensor:
        key = (split.n, split.k)
        if key not in pools:
            copies = max(2, POOL_BYTES // (split.n * split.k * 2))
            pools[key] = (torch.randn(copies, split.n, split.k, device="cuda") * 0.05).bfloat16()
        return pools[key]

    def phases_of(sequence: list[Split]) -> torch.Tensor:
        table = np.zeros(len(sequence), dtype=PHASE_DTYPE)
        for i, split in enumerate(sequence):
            weights = pool(split)
            out = partials.setdefault(i, {}).setdefault(
                split, torch.zeros(split.k // split.k_slice, ROWS, split.n, device="cuda"))
            table[i] = (weights.data_ptr(), split.n * split.k, weights.shape[0], out.data_ptr(), split.n, split.k,
                        split.n_tile, split.k_slice)
        return torch.from_numpy(table.view(np.uint8)).cuda()

    def elapsed_ms(phases: torch.Tensor, count: int, rounds: int, prefetch: bool) -> float:
        counter.zero_()
        torch.cuda.synchronize()
        start = stream.record(options=timing)
        launch(stream, LaunchConfig(grid=CTAS, block=THREADS, shmem_size=SHARED_BYTES), kernel,
               np.uint64(phases.data_ptr()), np.int32(count), np.int32(rounds), np.uint64(x.data_ptr()),
               np.int64(x.stride(0)), np.uint64(counter.data_ptr()), np.int32(int(prefetch)))
        end = stream.record(options=timing)
        end.sync()
        return end - start

    def phase_us(sequence: list[Split], prefetch: bool) -> float:
        phases = phases_of(sequence)
        elapsed_ms(phases, len(sequence), len(sequence), prefetch)                        # warm-up
        one = min(elapsed_ms(phases, len(sequence), len(sequence), prefetch) for _ in range(3))
        many = min(elapsed_ms(phases, len(sequence), len(sequence) * (ROUNDS + 1), prefetch) for _ in range(3))
        return (many - one) * 1e3 / (ROUNDS * len(sequence))

    def relative_error(split: Split) -> float:
        phases = phases_of([split])
        elapsed_ms(phases, 1, 1, True)
        torch.cuda.synchronize()
        ours = partials[0][split].sum(dim=0)
        expected = x[:, :split.k].float() @ pool(split)[0].float().T
        return float((ours - expected).abs().max() / expected.abs().max())

    print(f"kernel: {kernel.attributes.num_regs} registers a thread, {SHARED_BYTES} bytes of shared memory, "
          f"{CTAS} CTAs x {THREADS} threads; {ROUNDS} phases timed after one")
    print(f"{'linear':<26} {'n_tile':>6} {'k_slice':>7} {'prefetch us':>11} {'plain us':>8} {'cuBLASLt us':>11} "
          f"{'rel err':>8}")
    rows = []
    for split in SPLITS:
        row = Row(split.name, split.n_tile, split.k_slice, phase_us([split], True), phase_us([split], False),
                  relative_error(split))
        rows.append(row)
        print(f"{row.name:<26} {row.n_tile:>6} {row.k_slice:>7} {row.prefetch_us:11.2f} {row.plain_us:8.2f} "
              f"{CUBLAS_US[split.name]:11.2f} {row.relative_error:8.1e}", flush=True)
    layer_prefetch, layer_plain = phase_us(LAYER, True) * len(LAYER), phase_us(LAYER, False) * len(LAYER)
    cublas = sum(CUBLAS_US[s.name] for s in LAYER)
    print(f"a layer's {len(LAYER)} linears as phases: {layer_prefetch:.2f} us with prefetch, {layer_plain:.2f} "
          f"without; cuBLASLt {cublas:.2f} us of launches (+ ~0.5 us idle before each)")
    result = {"rows": [asdict(r) for r in rows], "layer_prefetch_us": layer_prefetch, "layer_plain_us": layer_plain}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return [asdict(r) for r in rows]


if __name__ == "__main__":
    main()
