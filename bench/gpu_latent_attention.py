"""Multi-head latent attention's decode kernel alone on the GPU (latent_attention.cu), at DeepSeek-V2-Lite's layer
(16 heads, a latent of 512 and a rotary key of 64 a token) and DeepSeek-V3's (128 heads): the latent cache's bytes
the batch's contexts hold over the kernel's time (with the merge of its splits), as a fraction of copy bandwidth,
for several split lengths.

Run from the repository root: python3 -m bench.gpu_latent_attention [--batches 1,64] [--contexts 1024,8192]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.kernel_variant import bench_libraries, time_launch_us

BLOCK = 64
RANK, ROPE = 512, 64
LAUNCHES = 4


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--partitions", default="auto,256,1024", help="tokens a split; auto: the launcher's choice")
    args = parser.parse_args(argv)
    from metrale.runtime.backend.cuda.kernels import latent_attention
    from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
    device, libraries = bench_libraries("latent_attention", [])
    lib, stream = libraries["package"], device.stream
    print(gpu_machine_line("gpu_latent_attention", "cuda"))
    bandwidth = copy_bandwidth("cuda", 2 * 10**9)
    width = RANK + ROPE
    print(f"# latent {RANK} + rotary {ROPE} bf16 a token; copy bandwidth {bandwidth / 1e12:.3f} TB/s; us a launch "
          f"(and the merge of its splits); x: the contexts' cache bytes / time / copy bandwidth")
    print(f"{'heads':>5} {'batch':>5} {'context':>7} {'partition':>9} {'splits':>6} {'us':>8} {'x':>5}")
    results = []
    for heads in (int(h) for h in args.heads.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                blocks = batch * -(-context // BLOCK)
                generator = torch.Generator(device="cuda").manual_seed(batch + context)
                cache = torch.randn(blocks * BLOCK, width, device="cuda", generator=generator).bfloat16()
                tables = torch.randperm(blocks, device="cuda", generator=generator).int().view(batch, -1)
                q = torch.randn(batch, heads * width, device="cuda", generator=generator).bfloat16()
                out = torch.empty(batch, heads * RANK, dtype=torch.bfloat16, device="cuda")
                rows = torch.arange(batch, dtype=torch.int32, device="cuda")
                contexts = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                bytes_read = batch * context * width * 2
                for choice in args.partitions.split(","):
                    partition = (latent_attention.partition_for(lib, batch, heads, context, RANK, ROPE)[0]
                                 if choice == "auto" else int(choice))
                    splits = -(-context // partition)
                    partials = torch.empty(latent_attention.partials_elements(batch, heads, RANK, splits),
                                           device="cuda")
                    launch = lambda: latent_attention.decode(  # noqa: E731
                        lib, stream, D.from_torch(out), D.from_torch(q), D.from_torch(cache), D.from_torch(rows),
                        D.from_torch(contexts), D.from_torch(tables), D.from_torch(rows), D.from_torch(partials),
                        heads, BLOCK, 0.1, context, partition)
                    us = time_launch_us(stream, launch, LAUNCHES)
                    fraction = bytes_read / (us * 1e-6) / bandwidth
                    results.append(dict(heads=heads, batch=batch, context=context, partition=partition, us=us,
                                        fraction=fraction))
                    print(f"{heads:5d} {batch:5d} {context:7d} {partition:9d} {splits:6d} {us:8.1f} {fraction:5.2f}",
                          flush=True)
                del cache, tables, q, out
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
