"""cuBLASLt's candidate algorithms for NLLB-200-600M's decode linears, each timed as the step finds its weights
(not in L2): is the heuristic's first choice the fastest? Needs a CUDA GPU.

For each linear and row count M, the heuristic's first --algos algorithms run in turn; each is timed as
bench/gpu_skinny_gemm.py times a kernel (a CUDA graph of launches cycling through weight copies that span 3x the
L2, events around its replays). The table gives the heuristic's choice, the fastest, and its place in the
heuristic's list.

--splits 1,2,4 times each linear also as float32 partials over K's slices (a strided batched GEMM whose sum a
following kernel would take, with the bias): does splitting K beat cuBLASLt's own choice at few rows?

Run from the repository root: python3 -m bench.gpu_gemm_algos [--tokens 4,16,64] [--algos 16] [--splits 1,2,4]
"""

import argparse

import torch

from bench.gpu_ceilings import gpu_machine_line
from bench.gpu_skinny_gemm import L2_SPAN, WORKSPACE_BYTES, time_per_launch

# (linear, N, K, bias, relu, out dtype): NLLB-200-600M's decoder linears and its LM head (rows padded to 64).
SHAPES = (("qkv", 3072, 1024, True, False, "bfloat16"), ("out", 1024, 1024, True, False, "bfloat16"),
          ("fc1", 4096, 1024, True, True, "bfloat16"), ("fc2", 1024, 4096, True, False, "bfloat16"),
          ("lm_head", 256256, 1024, False, False, "bfloat16"))
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def time_algos(lt, stream, n: int, k: int, bias: bool, relu: bool, out_dtype: str, m: int, count: int,
               min_launches: int, splits: int = 1) -> list[float]:
    """Seconds per launch of each of the heuristic's first `count` algorithms, in its order. splits > 1: float32
    partials of K's slices instead (no bias, no relu: the kernel after them would add those)."""
    if splits > 1:
        bias, relu, out_dtype = False, False, "float32"
    from metrale.runtime.backend.cuda.gemm_plan import linear_key
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    copies = -(-L2_SPAN * torch.cuda.get_device_properties(0).L2_cache_size // (n * k * 2))
    weights = [DeviceTensor.from_torch((torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16))
               for _ in range(copies)]
    keep = [torch.randn(m, k, device="cuda").to(torch.bfloat16),
            torch.empty(splits * m, n, dtype=TORCH_DTYPES[out_dtype], device="cuda"),
            torch.randn(n, device="cuda").to(TORCH_DTYPES[out_dtype])]
    x, out, b = (DeviceTensor.from_torch(t) for t in keep)
    b = b if bias else None
    key = linear_key(out, x, weights[0], b, relu, splits)
    candidates = lt.candidate_algos(key, count)
    times = []
    for candidate in candidates:
        lt.use_algo(key, candidate)
        lt.linear(stream, out, x, weights[0], b, relu=relu, splits=splits)       # outside the capture first
        stream.sync()
        times.append(time_per_launch(stream, [lambda w=weights[i % copies]: lt.linear(stream, out, x, w, b, relu=relu,
                                                                                      splits=splits)
                                              for i in range(max(min_launches, copies))]))
    lt.use_algo(key, candidates[0])
    return times


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4,16,64", help="M values, comma-separated")
    parser.add_argument("--algos", type=int, default=16, help="how many of the heuristic's algorithms to time")
    parser.add_argument("--splits", default="1", help="K splits into float32 partials, comma-separated (1: none)")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="linears, comma-separated")
    parser.add_argument("--launches", type=int, default=24, help="launches per graph (more if the weight copies are)")
    args = parser.parse_args(argv)

    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    print(gpu_machine_line("gpu_gemm_algos", "cuda"))
    cuda = CudaDevice()
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    print(f"{'linear':<8} {'N x K':>12} {'M':>3} {'split':>5} {'algos':>5} {'first us':>9} {'best us':>8} "
          f"{'best at':>7} {'first/best':>10}  all (us, heuristic order)")
    results = []
    wanted = args.shapes.split(",")
    for name, n, k, bias, relu, out_dtype in (s for s in SHAPES if s[0] in wanted):
        for m, splits in ((int(t), int(s)) for t in args.tokens.split(",") for s in args.splits.split(",")):
            times = time_algos(lt, cuda.stream, n, k, bias, relu, out_dtype, m, args.algos, args.launches, splits)
            best = min(range(len(times)), key=times.__getitem__)
            print(f"{name:<8} {f'{n}x{k}':>12} {m:>3} {splits:>5} {len(times):>5} {times[0] * 1e6:9.2f} "
                  f"{times[best] * 1e6:8.2f} {best:>7} {times[0] / times[best]:10.2f}  {' '.join(f'{t * 1e6:.1f}' for t in times)}",
                  flush=True)
            results.append({"linear": name, "n": n, "k": k, "m": m, "splits": splits, "times_s": times})
    lt.close()
    return results


if __name__ == "__main__":
    main()
