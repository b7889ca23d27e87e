"""The device search's candidates alone (beam.cu's beam_state_parts and beam_state_merge, which each decode step
runs on the LM head's bf16 logits): µs a step at NLLB-200's vocabulary for 1, 16 and 64 requests of 4 beams, EOS
banned (min_new_tokens = max_new_tokens, as bench/beam_generate.py runs), and the logits' bytes over that time
against the copy bandwidth of the same run (DESIGN.md §6: one read of the logits is the floor).

`--variant NAME=FILE` times a variant of beam.cu beside the package's, in the same run and on the same logits, and
checks that it picks the same candidates (a kernel change's before and after in one call of the lent GPU).

Each case is a CUDA graph of back-to-back steps timed with events (gemm_tuning.time_per_launch); the steps cycle
through logits copies spanning 3x the L2, as a step finds the LM head's output (partly in L2: the figure is an
upper bound on the step's own). Run from the repository root:
    python3 -m bench.gpu_beam_candidates [--requests 1,16,64] [--variant head=/path/beam.cu]
"""

import argparse

import numpy as np
import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.kernel_variant import add_variant_option, bench_libraries

VOCAB, BEAMS, KEEP, EOS = 256206, 4, 8, 2
L2_SPAN = 3
STEPS = 24                   # steps a timed graph


def search_state(ctx, requests: int):
    """A CudaDeviceSearch over `requests` NLLB prompts ([EOS, language]) of BEAMS beams, at its first step."""
    from metrale.runtime.backend.cuda.beam_search import CudaDeviceSearch, state_arrays, state_bytes
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    from metrale.runtime.beam.candidates import HostCandidates
    from metrale.runtime.beam.on_device import SearchStart

    i32 = lambda values: np.asarray(values, dtype=np.int32)
    R, TB = requests, requests * BEAMS
    prompts = [[EOS, 256047]] * R
    seeds = HostCandidates(torch.zeros((R, KEEP)), torch.zeros((R, KEEP), dtype=torch.int64))
    search = SearchStart(
        num_beams=i32([BEAMS] * R), beam_base=i32(range(0, TB, BEAMS)), prompt_len=i32([2] * R),
        max_length=i32([34] * R), min_new=i32([32] * R), ngram=i32([0] * R), early_stopping=i32([0] * R),
        best_length=i32([-1] * R), source_len=i32([32] * R), prompts=prompts,
        divisors=np.ones((R, 33), dtype=np.float32), eos=i32([EOS]), cross_tables=[[]] * R, tables=[[0]] * TB,
        block_ids=i32(range(8)), holders=i32([1] + [0] * 7), free=i32(range(7, 0, -1)),
        prompt_candidates=[(seeds, r) for r in range(R)], keep_stride=KEEP, block_size=16, max_len=34,
        table_width=1, encoder_decoder=False)
    arrays = state_arrays(search, ctx.shapes.max_blocks_per_seq)
    region = torch.empty(state_bytes(arrays, TB), dtype=torch.uint8, device="cuda")
    state = CudaDeviceSearch(ctx, search, arrays, forward=None, kv_cache=[], region=DeviceTensor.from_torch(region))
    state.region = region                                       # kept alive with the state
    return state


def run_case(libraries: dict, stream, requests: int) -> list[dict]:
    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch
    from metrale.runtime.backend.cuda.kernels.beam import beam_state_candidates
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    from metrale.runtime.backend.cuda.testing import BareStreamContext

    rows = requests * BEAMS
    stride = -(-VOCAB // 64) * 64                               # rows padded as the LM head's are
    row_bytes = rows * stride * 2
    copies = -(-L2_SPAN * torch.cuda.get_device_properties(0).L2_cache_size // row_bytes)
    generator = torch.Generator(device="cuda").manual_seed(requests)
    logits = [(torch.randn(rows, stride, device="cuda", generator=generator) * 3.0).bfloat16()
              for _ in range(copies)]
    views = [DeviceTensor.from_torch(t).columns(0, VOCAB) for t in logits]
    first = logits[0].clone()                                   # a step writes its bans into its logits
    results, picked = [], {}
    for name, lib in libraries.items():
        ctx = BareStreamContext(lib, stream)
        state = search_state(ctx, requests)
        step = lambda view: beam_state_candidates(lib, stream, view, state.state, rows, 0, 0, KEEP, state.scratch)
        logits[0].copy_(first)
        torch.cuda.synchronize()
        step(views[0])
        picked[name] = (ctx.copy_to_host(state.views["cand_ids"]), ctx.copy_to_host(state.views["cand_values"]))
        seconds = time_per_launch(stream, [lambda v=views[i % copies]: step(v) for i in range(STEPS)])
        results.append({"variant": name, "requests": requests, "rows": rows, "us": seconds * 1e6,
                        "bytes": rows * VOCAB * 2})
    first_ids, first_values = next(iter(picked.values()))
    for result in results:
        ids, values = picked[result["variant"]]
        result["same_ids"] = bool(np.array_equal(ids, first_ids))
        result["max_value_diff"] = float(np.abs(values - first_values).max())
    return results


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,16,64")
    add_variant_option(parser, "beam.cu")
    args = parser.parse_args(argv)
    device, libraries = bench_libraries("beam", args.variant)
    stream = device.stream
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    print(gpu_machine_line("gpu_beam_candidates", "cuda"))
    print(f"{'requests':>8} {'rows':>5}  {'variant':<12} {'us a step':>9} {'x floor':>8}  {'same ids':>8} "
          f"{'max value diff':>14}")
    rows = []
    for requests in (int(r) for r in args.requests.split(",")):
        for r in run_case(libraries, stream, requests):
            floor_us = r["bytes"] / bandwidth * 1e6          # one read of the logits at the copy's rate
            print(f"{r['requests']:8d} {r['rows']:5d}  {r['variant']:<12} {r['us']:9.2f} {r['us'] / floor_us:8.2f}  "
                  f"{str(r['same_ids']):>8} {r['max_value_diff']:14.2e}")
            rows.append(r)
    return rows


if __name__ == "__main__":
    main()
