"""An M2M100 decoder layer's decode step as one persistent kernel (docs/persistent_decoder.md, step 3 in bench
form): 64 rows (16 requests x 4 beams), d_model 1024, 16 heads of 64, FFN 4096, one CTA per SM and a grid-wide
barrier between its 12 dependent phases. Needs a CUDA GPU (sm_80 or later).

Phases, each layer (12): the norm over the previous fc2's partials (+ bias + residual), qkv, self-attention (its
query, key and value summed from qkv's partials with the bias; the new key and value written to the cache), the
out projection, its norm, the cross-attention query, cross-attention (over the request's source keys), the cross
out projection, its norm, fc1, its bias and ReLU (a phase of its own, spread over the CTAs), fc2. The linears are
gpu_persistent_gemm.py's phases (split-K tiles on tensor cores, the next linear's weight tile copied into shared
memory while the phases between run). Attention here reads a contiguous cache ([rows, positions, 1024], sources
[requests, positions, 1024]) instead of the paged one, a warp per (row, head).

It checks one layer against the same arithmetic in torch (bf16 roundings where the kernels round), then times
1 + LAYERS layers against 1, every layer on the next copy of the weights (from HBM, as a step's 12 layers are),
against the current path's kernels (session 14's kernel table at 16 requests, PDL off: ~45 µs a layer, plus ~6 µs
of idle device around cuBLASLt's kernels).

Its CUDA source is persistent_layer_kernel.py's DECODER_LAYERS. Run from the repository root:
python3 -m bench.gpu_persistent_layer
"""

import argparse
import json

import numpy as np
import torch

from bench.gpu_ceilings import gpu_machine_line
from bench.persistent_kernels import CTAS, PHASE_DTYPE, SHARED_BYTES, THREADS, Split, persistent_kernel
from bench.persistent_layer_kernel import DECODER_LAYERS, LAYER_BYTES, LAYER_FIELDS

REQUESTS, BEAMS, ROWS, HIDDEN, HEADS, HEAD_DIM, FFN = 16, 4, 64, 1024, 16, 64, 4096
CONTEXT, SOURCE_LEN, MAX_POSITIONS = 34, 32, 64
LAYERS = 48
POOL_BYTES = 512 << 20
# qkv, out, cross q, cross out, fc1, fc2: (n, k, n_tile, k_slice) over 128 CTAs.
LINEARS = [Split("qkv", 3 * HIDDEN, HIDDEN, 96, 256), Split("out", HIDDEN, HIDDEN, 64, 128),
           Split("cross q", HIDDEN, HIDDEN, 64, 128), Split("cross out", HIDDEN, HIDDEN, 64, 128),
           Split("fc1", FFN, HIDDEN, 128, 256), Split("fc2", HIDDEN, FFN, 64, 512)]
CURRENT_US = 45.3          # the current path's kernels a layer (session 14, PDL off), idle device not counted
def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


class Model:
    """The layer's weights (pools of copies), its buffers, and the same arithmetic in torch."""

    def __init__(self, generator: torch.Generator):
        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=generator) * scale).bfloat16().cuda()

        self.pools = []
        for split in LINEARS:
            copies = max(2, POOL_BYTES // (split.n * split.k * 2))
            pool = torch.empty(copies, split.n, split.k, dtype=torch.bfloat16, device="cuda")
            pool.normal_(0, split.k ** -0.5)
            self.pools.append(pool.bfloat16())
        self.biases = [randn(s.n, scale=0.1) for s in LINEARS]
        self.norm_weights = [(1 + 0.1 * torch.randn(HIDDEN, generator=generator)).bfloat16().cuda() for _ in range(3)]
        self.norm_biases = [randn(HIDDEN, scale=0.1) for _ in range(3)]
        self.partials = [torch.zeros(s.k // s.k_slice, ROWS, s.n, device="cuda") for s in LINEARS]
        self.partials[5].copy_(torch.randn(self.partials[5].shape, generator=generator) * 0.3)
        self.h, self.o = (torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        self.f = torch.zeros(ROWS, FFN, dtype=torch.bfloat16, device="cuda")
        self.residual = randn(ROWS, HIDDEN)
        self.self_k, self.self_v = (randn(ROWS, MAX_POSITIONS, HIDDEN) for _ in range(2))
        self.cross_k, self.cross_v = (randn(REQUESTS, SOURCE_LEN, HIDDEN) for _ in range(2))
        self.counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.scale_log2 = HEAD_DIM ** -0.5 * 1.4426950408889634

    def table(self) -> torch.Tensor:
        record = np.zeros(1, dtype=np.dtype(LAYER_FIELDS))
        for i, (split, pool, part) in enumerate(zip(LINEARS, self.pools, self.partials)):
            values = (pool.data_ptr(), split.n * split.k, pool.shape[0], part.data_ptr(), split.n, split.k,
                      split.n_tile, split.k_slice)
            for (name, _), value in zip(PHASE_DTYPE.descr, values):
                record[f"linear{i}_{name}"] = value
            record[f"bias{i}"] = self.biases[i].data_ptr()
        for i in range(3):
            record[f"norm_weight{i}"] = self.norm_weights[i].data_ptr()
            record[f"norm_bias{i}"] = self.norm_biases[i].data_ptr()
        for name in ("h", "o", "f", "residual", "self_k", "self_v", "cross_k", "cross_v", "counter"):
            record[name] = getattr(self, name).data_ptr()
        record["max_positions"], record["context"], record["source"] = MAX_POSITIONS, CONTEXT, SOURCE_LEN
        record["scale_log2"], record["eps"] = self.scale_log2, 1e-5
        return torch.from_numpy(record.view(np.uint8)).cuda()

    def reference(self) -> dict[str, torch.Tensor]:
        """One layer (weight copy 0) from the buffers as they are now, in float32 with the kernels' roundings."""
        w = [pool[0].float() for pool in self.pools]
        b = [bias.float() for bias in self.biases]

        def output(x: torch.Tensor, i: int) -> torch.Tensor:
            return bf16(x @ w[i].T + b[i])

        def norm(residual, t, i):
            residual = bf16(residual + t)
            mean = residual.mean(-1, keepdim=True)
            var = ((residual - mean) ** 2).mean(-1, keepdim=True)
            h = bf16((residual - mean) * torch.rsqrt(var + 1e-5) * self.norm_weights[i].float()
                     + self.norm_biases[i].float())
            return residual, h

        def attention(q, k, v):     # q [rows, heads, d], k/v [rows, keys, heads, d]
            scores = torch.einsum("rhd,rkhd->rhk", q, k) * HEAD_DIM ** -0.5
            return bf16(torch.einsum("rhk,rkhd->rhd", torch.softmax(scores, -1), v))

        residual, h = norm(self.residual.float(), bf16(self.partials[5].sum(0) + b[5]), 0)
        qkv = output(h, 0)
        q, k_new, v_new = (qkv[:, i * HIDDEN:(i + 1) * HIDDEN].view(ROWS, HEADS, HEAD_DIM) for i in range(3))
        keys = self.self_k[:, :CONTEXT].float().clone().view(ROWS, CONTEXT, HEADS, HEAD_DIM)
        values = self.self_v[:, :CONTEXT].float().clone().view(ROWS, CONTEXT, HEADS, HEAD_DIM)
        keys[:, -1], values[:, -1] = k_new, v_new
        o = attention(q, keys, values).view(ROWS, HIDDEN)
        residual, h = norm(residual, output(o, 1), 1)
        q = output(h, 2).view(ROWS, HEADS, HEAD_DIM)
        source_k = self.cross_k.float().repeat_interleave(BEAMS, 0).view(ROWS, SOURCE_LEN, HEADS, HEAD_DIM)
        source_v = self.cross_v.float().repeat_interleave(BEAMS, 0).view(ROWS, SOURCE_LEN, HEADS, HEAD_DIM)
        o = attention(q, source_k, source_v).view(ROWS, HIDDEN)
        residual, h = norm(residual, output(o, 3), 2)
        f = bf16(torch.relu(h @ w[4].T + b[4]))
        return {"residual": residual, "h": h, "o": o, "fc2": output(f, 5)}


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs).abs().max() / theirs.abs().max())


def main(argv=None) -> dict:
    from cuda.core import EventOptions, LaunchConfig, launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for split in LINEARS:
        split.check()
    assert np.dtype(LAYER_FIELDS).itemsize == LAYER_BYTES

    print(gpu_machine_line("gpu_persistent_layer", "cuda"))
    cuda, kernel = persistent_kernel("persistent_layer", DECODER_LAYERS, "decoder_layers")
    stream, timing = cuda.stream, EventOptions(timing_enabled=True)
    model = Model(torch.Generator().manual_seed(0))
    table = model.table()

    def run(layers: int) -> float:
        model.counter.zero_()
        torch.cuda.synchronize()
        start = stream.record(options=timing)
        launch(stream, LaunchConfig(grid=CTAS, block=THREADS, shmem_size=SHARED_BYTES), kernel,
               np.uint64(table.data_ptr()), np.int32(layers))
        end = stream.record(options=timing)
        end.sync()
        return end - start

    expected = model.reference()
    run(1)
    torch.cuda.synchronize()
    errors = {"residual": relative_error(model.residual, expected["residual"]),
              "h": relative_error(model.h, expected["h"]), "o (cross)": relative_error(model.o, expected["o"]),
              "fc2": relative_error(bf16(model.partials[5].sum(0) + model.biases[5].float()), expected["fc2"])}
    print(f"kernel: {kernel.attributes.num_regs} registers a thread, {SHARED_BYTES} bytes of dynamic shared memory, "
          f"{CTAS} CTAs x {THREADS} threads")
    print("one layer against torch, relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    run(1)                                                     # warm-up
    one = min(run(1) for _ in range(3))
    many = min(run(1 + LAYERS) for _ in range(3))
    layer_us = (many - one) * 1e3 / LAYERS
    print(f"a layer as 12 phases: {layer_us:.2f} us ({LAYERS} layers timed after one, each on its own weight copy); "
          f"the current path's kernels {CURRENT_US:.1f} us a layer (+ ~6 us idle device): "
          f"{CURRENT_US / layer_us:.2f}x")
    result = {"layer_us": layer_us, "errors": errors}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
