"""DeepSeek sparse attention's decode against dense latent attention over the same cache, kernels alone on the GPU,
at Hy4's layer (32 heads over a latent of 512 and a rotary key of 64; an indexer of 16 heads of 128 keeping 2048
tokens): the indexer's scores and top-k, then the latent attention over the chosen tokens, beside the latent
attention over every token; each with the bytes it must read over its time, as a fraction of copy bandwidth.

Run from the repository root: python3 -m bench.gpu_sparse_attention [--batches 1,64] [--contexts 4096,32768]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.gpu_latent_attention import BLOCK, LAUNCHES, RANK, ROPE
from bench.kernel_variant import bench_libraries, time_launch_us


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--index-heads", type=int, default=16)
    parser.add_argument("--index-dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    args = parser.parse_args(argv)
    from metrale.runtime.backend.cuda.kernels import latent_attention, sparse_index
    from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
    device, libraries = bench_libraries("latent_attention", [])
    lib, stream = libraries["package"], device.stream
    print(gpu_machine_line("gpu_sparse_attention", "cuda"))
    bandwidth = copy_bandwidth("cuda", 2 * 10**9)
    heads, index_heads, dim, topk, width = args.heads, args.index_heads, args.index_dim, args.topk, RANK + ROPE
    print(f"# {heads} heads over a latent of {RANK} + {ROPE}; indexer {index_heads} x {dim}, top {topk}; copy "
          f"bandwidth {bandwidth / 1e12:.3f} TB/s; us a step's layer; x: the bytes it must read (dense: every "
          f"latent; sparse: every index key, the chosen latents) / time / copy bandwidth")
    print(f"{'batch':>5} {'context':>7} {'dense us':>9} {'x':>5} {'scores us':>9} {'top-k us':>8} {'chosen us':>9} "
          f"{'sparse us':>9} {'x':>5} {'dense/sparse':>12}")
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            g = torch.Generator(device="cuda").manual_seed(batch + context)
            blocks = batch * -(-context // BLOCK)
            cache = torch.randn(blocks * BLOCK, width, device="cuda", generator=g).bfloat16()
            keys = torch.randn(blocks * BLOCK, dim, device="cuda", generator=g).bfloat16()
            tables = torch.randperm(blocks, device="cuda", generator=g).int().view(batch, -1)
            q = torch.randn(batch, heads * width, device="cuda", generator=g).bfloat16()
            index_q = torch.randn(batch, index_heads * dim, device="cuda", generator=g).bfloat16()
            weights = torch.randn(batch, index_heads, device="cuda", generator=g)
            out = torch.empty(batch, heads * RANK, dtype=torch.bfloat16, device="cuda")
            rows = torch.arange(batch, dtype=torch.int32, device="cuda")
            contexts = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            scores = torch.empty(batch, context, device="cuda")
            selected = torch.empty(batch, topk, dtype=torch.int32, device="cuda")
            counts = torch.empty(batch, dtype=torch.int32, device="cuda")
            splits = latent_attention.partition_for(lib, batch, heads, context, RANK, ROPE)[1]
            partials = torch.empty(latent_attention.partials_elements(batch, heads, RANK, max(splits, 64)),
                                   device="cuda")
            t = {name: D.from_torch(x) for name, x in dict(
                cache=cache, keys=keys, tables=tables, q=q, index_q=index_q, weights=weights, out=out, rows=rows,
                contexts=contexts, scores=scores, selected=selected, counts=counts, partials=partials).items()}

            def dense():
                latent_attention.decode(lib, stream, t["out"], t["q"], t["cache"], t["rows"], t["contexts"],
                                        t["tables"], None, t["partials"], heads, BLOCK, 0.1, context)

            def score():
                sparse_index.scores(lib, stream, t["scores"], t["index_q"], t["weights"], t["keys"], t["rows"],
                                    t["contexts"], t["tables"], None, BLOCK, context)

            def top():
                sparse_index.top_k(lib, stream, t["selected"], t["counts"], t["scores"], t["contexts"], topk)

            def chosen():
                latent_attention.decode(lib, stream, t["out"], t["q"], t["cache"], t["rows"], t["contexts"],
                                        t["tables"], None, t["partials"], heads, BLOCK, 0.1, min(topk, context),
                                        selected=t["selected"], selected_counts=t["counts"])

            torch.cuda.synchronize()        # the inputs, made on torch's stream, before the kernels' stream reads them
            score()
            top()
            times = {name: time_launch_us(stream, launch, LAUNCHES)
                     for name, launch in (("dense", dense), ("scores", score), ("top-k", top), ("chosen", chosen))}
            sparse_us = times["scores"] + times["top-k"] + times["chosen"]
            dense_bytes = batch * context * width * 2
            sparse_bytes = batch * (context * dim + min(topk, context) * width) * 2
            row = dict(batch=batch, context=context, sparse_us=sparse_us, **{f"{k}_us": v for k, v in times.items()},
                       dense_fraction=dense_bytes / (times["dense"] * 1e-6) / bandwidth,
                       sparse_fraction=sparse_bytes / (sparse_us * 1e-6) / bandwidth)
            results.append(row)
            print(f"{batch:5d} {context:7d} {times['dense']:9.1f} {row['dense_fraction']:5.2f} "
                  f"{times['scores']:9.1f} {times['top-k']:8.1f} {times['chosen']:9.1f} {sparse_us:9.1f} "
                  f"{row['sparse_fraction']:5.2f} {times['dense'] / sparse_us:12.2f}", flush=True)
            del cache, keys, tables, scores
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
