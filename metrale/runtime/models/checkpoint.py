"""What every family reads of a Hugging Face checkpoint the same way: its tensors by name, and its EOS ids."""

import re
from collections.abc import Mapping
from typing import Callable

import torch

from metrale.runtime.errors import InvalidArgument


def tensor_reader(tensors: dict[str, torch.Tensor], architecture: str, as_float: bool = False
                  ) -> Callable[[str], torch.Tensor]:
    """take(name): the checkpoint's tensor (float32 with as_float: a family that scales weights before upload), or
    InvalidArgument naming the tensor the architecture needs."""
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise InvalidArgument(f"the checkpoint has no tensor {name!r} that {architecture} needs")
        return tensors[name].float() if as_float else tensors[name]
    return take


def eos_token_ids(hf: dict) -> tuple[int, ...]:
    """config.json's eos_token_id (absent, one id, or a list) as a tuple."""
    eos = hf.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def scaled_tied_head_bytes(config) -> int:
    """A model's extra_weight_bytes where it scales its tied LM head apart from its embedding: with
    tie_word_embeddings, the one checkpoint table uploaded twice (bf16, 256-byte aligned)."""
    return 2 * config.vocab_size * config.hidden_size + 256 if config.tie_word_embeddings else 0


class Renamed(Mapping):
    """A checkpoint's tensors under the names transformers gives them where the released checkpoint names them
    otherwise: renames [(pattern, replacement)], applied in order to each released name (names already renamed
    map to themselves). Reads nothing until a tensor is taken."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], renames: list[tuple[str, str]]):
        self.tensors = tensors
        self.names = {}
        for name in tensors.keys():
            renamed = name
            for pattern, replacement in renames:
                renamed = re.sub(pattern, replacement, renamed)
            self.names[renamed] = name

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]]

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def kv_scales(tensors, prefix: str, num_kv_heads: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """An attention layer's FP8 KV cache scales as the checkpoint gives them (a kv_cache_scheme's prefix + "k_scale"
    and "v_scale": one for every head, or one a KV head), each K or V value over its head's; None where it has
    none (cache/specs.py's PagedKvFp8 then takes 1)."""
    names = (prefix + "k_scale", prefix + "v_scale")
    if not any(name in tensors for name in names):
        return None
    if missing := [name for name in names if name not in tensors]:
        raise InvalidArgument(f"the checkpoint has {' and '.join(n for n in names if n in tensors)} but no "
                              f"{missing[0]!r}")
    scales = []
    for name in names:
        values = tensors[name].float().flatten()
        if values.numel() not in (1, num_kv_heads) or not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise InvalidArgument(f"{name} must be one positive scale or one per KV head ({num_kv_heads}), not "
                                  f"{values.tolist()}")
        scales.append(tuple(values.expand(num_kv_heads).tolist()))
    return scales[0], scales[1]
