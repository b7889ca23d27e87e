"""Linears that read one input run as one GEMM: their weights stacked by rows, each part's rows padded to a multiple
of PART_ALIGN (so each part's columns of the output start 16-byte aligned on the CUDA backend), and the output handed
back as each part's columns. At a decode's few rows a small GEMM costs its launch and latency more than its bytes:
DeepSeek's query and latent projections, Hy4's gate and the indexer's key all read the layer's normed input."""

from dataclasses import dataclass

import torch

from metrale.runtime.backend.layer_math import LayerMath
from metrale.runtime.loading.fp8 import Fp8Weight

PART_ALIGN = 8              # rows: 16 bytes of bf16 output


@dataclass(frozen=True)
class FusedLinear:
    weight: object                          # [sum of the padded parts' rows, K], uploaded
    bias: object | None
    parts: dict[str, tuple[int, int]]       # each part's columns of the output: [start, stop)

    def __call__(self, ops: LayerMath, x) -> dict:
        """Each part's output: a view of the one GEMM's columns."""
        out = ops.linear(x, self.weight, self.bias)
        return {name: out[:, start:stop] for name, (start, stop) in self.parts.items()}


def fuse(ops: LayerMath, weights: dict[str, torch.Tensor], biases: dict[str, torch.Tensor] | None = None
         ) -> FusedLinear:
    """The parts' weights [N_i, K] (in order) as one linear; biases: some parts' [N_i] (the others' zero), or None."""
    stacked, bias_rows, parts, start = [], [], {}, 0
    for name, weight in weights.items():
        pad = padding_rows(weight.shape[0])
        stacked += [weight, zero_rows(weight, pad)] if pad else [weight]
        if biases is not None:
            bias = biases.get(name)
            bias_rows += [bias if bias is not None else torch.zeros(weight.shape[0]), torch.zeros(pad)]
        parts[name] = (start, start + weight.shape[0])
        start += weight.shape[0] + pad
    bias = ops.upload(torch.cat(bias_rows)) if biases is not None else None
    return FusedLinear(ops.upload(torch.cat(stacked)), bias, parts)


def zero_rows(weight, rows: int):
    """rows zero rows of weight's width, in its form: an FP8 weight's stay FP8 (so the stack does)."""
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(torch.zeros(rows, weight.shape[1], dtype=weight.data.dtype),
                         torch.ones(rows, weight.scales.shape[1]), weight.block)
    return torch.zeros(rows, weight.shape[1], dtype=weight.dtype)


def padding_rows(rows: int) -> int:
    """The zero rows after a part of `rows` rows."""
    return -rows % PART_ALIGN
