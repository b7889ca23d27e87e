"""An encoder's output as an encoder-decoder's cross-attention reads it: per decoder layer, the K and V of the packed
states of a batch of sources, and each source's rows."""

from dataclasses import dataclass

import torch


@dataclass
class Encoded:
    spans: list[tuple[int, int]]     # each source's (first row, length) in the packed states
    keys: list                       # per decoder layer, [rows, hidden]
    values: list

    def split(self) -> list["Encoded"]:
        """One Encoded per source (views of these rows): what a sequence keeps between steps."""
        return [Encoded([(0, n)], [k[s:s + n] for k in self.keys], [v[s:s + n] for v in self.values])
                for s, n in self.spans]

    @staticmethod
    def merge(parts: list["Encoded"]) -> "Encoded":
        """The sources of several single-source parts packed in order, for one forward over their sequences.
        (Host tensors: the CUDA backend will keep cross-attention K/V in paged blocks instead.)"""
        spans, start = [], 0
        for part in parts:
            spans.append((start, part.spans[0][1]))
            start += part.spans[0][1]
        layers = range(len(parts[0].keys))
        return Encoded(spans, [torch.cat([p.keys[i] for p in parts]) for i in layers],
                       [torch.cat([p.values[i] for p in parts]) for i in layers])
