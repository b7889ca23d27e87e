"""Scratch (not committed): SASS stats and timings of attention.cu on the device machine."""
import os
import re
import subprocess
import time

import torch
from cuda.core import Device

from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary, compile_cubin, kernel_sources
from metrale.runtime.backend.cuda.kernels.attention import (decode_partition, decode_workspace_elements,
                                                            paged_decode_attention, paged_prefill_attention)
from metrale.runtime.backend.cuda.tensor import DeviceTensor as D

out_dir = os.environ.get("OUT", "/tmp")
cubin = compile_cubin("attention", kernel_sources()["attention"], "sm_90a")
open(f"{out_dir}/attention.cubin", "wb").write(cubin)
sass = subprocess.run(["cuobjdump", "-sass", f"{out_dir}/attention.cubin"], capture_output=True, text=True).stdout
open(f"{out_dir}/attention.sass", "w").write(sass)
for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=Function :|\Z)", sass, re.S):
    counts = {op: len(re.findall(rf"\b{op}\b", body)) for op in ("LDL", "STL", "HMMA", "LDGSTS", "LDSM", "BAR")}
    print(name, counts)

device = Device(0)
device.set_current()
lib = KernelLibrary("sm_90a", KernelCache("/tmp/kc"))
stream = device.create_stream()


def timed(fn, iterations=20):
    fn()
    stream.sync()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    stream.sync()
    return (time.perf_counter() - start) / iterations


copy_src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
copy_dst = torch.empty_like(copy_src)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    copy_dst.copy_(copy_src)
torch.cuda.synchronize()
copy_bw = 2 * copy_src.numel() * 10 / (time.perf_counter() - t0)
print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
del copy_src, copy_dst

for batch, context, num_heads, kvh, hd in [(64, 4096, 32, 8, 128), (64, 4096, 64, 8, 128), (1, 32768, 32, 8, 128),
                                           (256, 1024, 32, 8, 128), (64, 4096, 32, 32, 128), (64, 4096, 16, 2, 64)]:
    bs = 16
    blocks = batch * context // bs
    kv = torch.randn(2, blocks, bs, kvh, hd, device="cuda").bfloat16()
    tables = torch.randperm(blocks, device="cuda").int().view(batch, context // bs)
    q = torch.randn(batch, num_heads * hd, device="cuda").bfloat16()
    out = torch.empty_like(q)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    ws = torch.empty(max(decode_workspace_elements(batch, num_heads, kvh, hd, context), 4), device="cuda")
    torch.cuda.synchronize()
    args = (lib, stream, D.from_torch(out), D.from_torch(q), D.from_torch(kv), D.from_torch(rows), D.from_torch(lens),
            D.from_torch(tables), D.from_torch(ws), num_heads, kvh, hd, hd ** -0.5, -1, context)
    seconds = timed(lambda: paged_decode_attention(*args))
    kv_bytes = kv.numel() * 2
    print(f"decode B={batch} ctx={context} H={num_heads} kvh={kvh} hd={hd} splits={decode_partition(batch, kvh, context)}"
          f": {seconds * 1e6:.0f} us, {kv_bytes / seconds / 1e12:.2f} TB/s = {kv_bytes / seconds / copy_bw:.2f} of copy")
    del kv

for n, num_heads, kvh, hd in [(4096, 32, 8, 128), (16384, 32, 8, 128), (4096, 32, 8, 64), (512, 32, 8, 128)]:
    bs = 16
    blocks = n // bs
    kv = torch.randn(2, blocks, bs, kvh, hd, device="cuda").bfloat16()
    tables = torch.randperm(blocks, device="cuda").int().view(1, -1)
    q = torch.randn(n, num_heads * hd, device="cuda").bfloat16()
    out = torch.empty_like(q)
    one = lambda x: torch.tensor([x], device="cuda", dtype=torch.int32)  # noqa: E731
    starts, lens = one(0), one(n)
    torch.cuda.synchronize()
    args = (lib, stream, D.from_torch(out), D.from_torch(q), D.from_torch(kv), D.from_torch(starts), D.from_torch(lens),
            D.from_torch(lens), D.from_torch(tables), num_heads, kvh, hd, hd ** -0.5, -1, 1, n)
    seconds = timed(lambda: paged_prefill_attention(*args), 10)
    flops = 4 * n * n / 2 * hd * num_heads
    print(f"prefill n={n} H={num_heads} kvh={kvh} hd={hd}: {seconds * 1e3:.2f} ms, {flops / seconds / 1e12:.0f} TFLOP/s"
          " (causal FLOPs)")
