"""The multi-head decode attention kernels as an NLLB-200-600M beam step runs them (16 heads of 64, KV blocks of
16, 16 requests of 4 beams: 64 rows): the self-attention that writes each row's new token and attends it
(`paged_decode_attention_mha_new`, at a few contexts of the generation) and the cross-attention that sums its query
from the q projection's split-K partials (`paged_decode_attention_mha_partial_q`, 32 source tokens whose KV the
request's beams share). µs a launch, each launch serialized after the one before (PDL off: as after the cuBLASLt
GEMM that precedes each in a step) and back to back with PDL; launches cycle through KV copies spanning 3x the
L2. Each output is checked against torch's attention over the same keys. A second shape, 32 heads of 128 (an MHA
decoder like Llama-2-7B) at 8 sequences of 512 and 2048 tokens, keeps an eye on the kernels' head_dim-128 build.

`--variant NAME=FILE` times another decode_attention_mha.cu beside the package's, in the same run (an old kernel
is given M2M100's identity rotation tables where the package's takes none).

Run from the repository root: python3 -m bench.gpu_mha_attention [--variant main=/tmp/old.cu]
"""

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.gpu_ceilings import gpu_machine_line
from bench.kernel_variant import add_variant_option, bench_libraries

BLOCK, SPLITS = 16, 4                         # KV block size; the cross query's split-K partials
LAUNCHES = 24                                 # launches a timed graph


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    head_dim: int
    requests: int
    beams: int
    self_contexts: tuple
    source: int = 0                           # the cross-attention's keys (0: none)


SHAPES = (Shape("nllb-600m", 16, 64, 16, 4, (2, 17, 33), 32),
          # an MHA decoder with head_dim 128 (Llama-2-7B's heads), 8 sequences at long contexts
          Shape("mha-hd128", 32, 128, 8, 1, (512, 2048)))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


class Case:
    """One launch's inputs on the device, KV copies to cycle through, and torch's output for the first copy."""

    def __init__(self, lib, shape: Shape, kind: str, context: int):
        from metrale.runtime.backend.cuda.kernels.attention import decode_workspace_elements
        heads, head_dim = shape.heads, shape.head_dim
        rows, width = shape.requests * shape.beams, heads * head_dim
        self.shape, self.kind, self.resources, self.rows = shape, kind, context, rows
        owners = rows if kind == "self" else shape.requests     # the cross KV is the request's, shared by its beams
        per_owner = math.ceil(context / BLOCK)
        blocks = owners * per_owner
        kv = torch.randn(2, blocks, BLOCK, heads, head_dim, device="cuda").bfloat16()
        order = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(owners, per_owner)
        self.tables = (order if kind == "self" else order.repeat_interleave(shape.beams, 0)).contiguous()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.caches = [kv] + [kv.clone() for _ in range(math.ceil(3 * l2 / kv.nbytes) - 1)]
        self.seq_rows = torch.arange(rows, device="cuda", dtype=torch.int32)
        self.contexts = torch.full((rows,), context, device="cuda", dtype=torch.int32)
        self.out = torch.empty(rows, width, device="cuda").bfloat16()
        elements = decode_workspace_elements(lib, rows, heads, heads, head_dim, context)
        self.workspace = torch.empty(max(elements, 4), device="cuda") if elements else None
        if kind == "self":                                      # q, k, v of the new token: a qkv row each
            self.qkv = torch.randn(rows, 3 * width, device="cuda").bfloat16()
            last = context - 1
            self.slots = (self.tables[:, last // BLOCK] * BLOCK + last % BLOCK).contiguous()
            self.positions = torch.full((rows,), last, device="cuda", dtype=torch.int32)
            self.cos = torch.ones(context + 1, head_dim // 2, device="cuda")       # identity rotation tables
            self.sin = torch.zeros(context + 1, head_dim // 2, device="cuda")
            query = self.qkv[:, :width]
        else:
            self.partials = torch.randn(SPLITS * rows, width, device="cuda") * 0.5
            self.bias = torch.randn(width, device="cuda").bfloat16()
            query = (self.partials.view(SPLITS, rows, width).sum(0) + self.bias.float()).bfloat16()
        self.reference = self._reference(query)

    def _reference(self, query: torch.Tensor) -> torch.Tensor:
        heads, head_dim = self.shape.heads, self.shape.head_dim
        kv, width = self.caches[0].clone(), heads * head_dim
        if self.kind == "self":                                 # the new token's key and value in the cache
            flat = kv.view(2, -1, heads, head_dim)
            flat[0, self.slots.long()] = self.qkv[:, width:2 * width].view(-1, heads, head_dim)
            flat[1, self.slots.long()] = self.qkv[:, 2 * width:].view(-1, heads, head_dim)
        keys, values = (kv[p][self.tables.long()].view(self.rows, -1, heads, head_dim)[:, :self.resources]
                        .transpose(1, 2).float() for p in (0, 1))
        q = query.view(self.rows, heads, 1, head_dim).float()
        return F.scaled_dot_product_attention(q, keys, values, scale=head_dim ** -0.5).view(self.rows, width)

    def launcher(self, lib, stream, rotation_tables: bool):
        """A launch on cache copy i (a callable of i)."""
        from metrale.runtime.backend.cuda.kernels.attention import (NewTokens, QueryPartials,
                                                                     paged_decode_attention)
        from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
        heads, head_dim = self.shape.heads, self.shape.head_dim
        width = heads * head_dim
        caches = [D.from_torch(c) for c in self.caches]
        out, rows, contexts, tables = (D.from_torch(t) for t in (self.out, self.seq_rows, self.contexts, self.tables))
        workspace = None if self.workspace is None else D.from_torch(self.workspace)
        if self.kind == "self":
            tables_of = (D.from_torch(self.cos), D.from_torch(self.sin)) if rotation_tables else (None, None)
            extra = {"new_tokens": NewTokens(D.from_torch(self.qkv[:, width:2 * width]),
                                             D.from_torch(self.qkv[:, 2 * width:]), *tables_of,
                                             D.from_torch(self.positions), D.from_torch(self.slots))}
            q = D.from_torch(self.qkv[:, :width])
        else:
            extra = {"q_partials": QueryPartials(SPLITS, D.from_torch(self.bias))}
            q = D.from_torch(self.partials)
        return lambda i: paged_decode_attention(lib, stream, out, q, caches[i % len(caches)], rows, contexts, tables,
                                                workspace, heads, heads, head_dim, head_dim ** -0.5, -1, self.resources,
                                                **extra)


def run(libraries: dict, stream) -> list[dict]:
    """Each shape's cases, each library's kernel on them: the package's also without rotation tables (what M2M100
    passes; an older kernel may not take that), every other with identity tables."""
    from metrale.runtime.backend.cuda import launch
    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch
    pdl = launch.programmatic_launch()
    results = []
    for shape in SHAPES:
        cases = [("self", c) for c in shape.self_contexts] + ([("cross", shape.source)] if shape.source else [])
        for kind, context in cases:
            case = Case(libraries["package"], shape, kind, context)
            for name, lib in libraries.items():
                for tables in ((False, True) if name == "package" else (True,)) if kind == "self" else (False,):
                    launch_one = case.launcher(lib, stream, tables)
                    torch.cuda.synchronize()
                    case.out.fill_(float("nan"))
                    launch_one(0)
                    stream.sync()
                    error = relative_error(case.out, case.reference)
                    cells = {}
                    for mode in (False, True):
                        launch.use_programmatic_launch(pdl and mode)
                        launches = [lambda i=i: launch_one(i) for i in range(LAUNCHES)]
                        cells[mode] = time_per_launch(stream, launches) * 1e6
                    launch.use_programmatic_launch(pdl)
                    label = name + (" +tables" if kind == "self" and tables and name == "package" else "")
                    results.append({"shape": shape.name, "rows": case.rows, "kind": kind, "context": context,
                                    "variant": label, "serial_us": cells[False], "pdl_us": cells[True],
                                    "rel_err": error})
            del case
    return results


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_variant_option(parser, "decode_attention_mha.cu")
    args = parser.parse_args(argv)
    device, libraries = bench_libraries("decode_attention_mha", args.variant)
    print(gpu_machine_line("gpu_mha_attention", "cuda"))
    print("# " + "; ".join(f"{s.name}: {s.requests * s.beams} rows, {s.heads} heads of {s.head_dim}" for s in SHAPES)
          + "; µs a launch")
    print(f"{'shape':<10} {'kind':>5} {'context':>7}  {'variant':<16} {'serial us':>9} {'PDL us':>7} {'rel err':>8}")
    results = run(libraries, device.stream)
    for r in results:
        print(f"{r['shape']:<10} {r['kind']:>5} {r['context']:7d}  {r['variant']:<16} {r['serial_us']:9.2f} "
              f"{r['pdl_us']:7.2f} {r['rel_err']:8.1e}")
    return results


if __name__ == "__main__":
    main()
