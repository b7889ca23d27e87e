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


def kv_scales(tensors, prefix: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """An attention layer's FP8 KV cache scales as the checkpoint gives them (a kv_cache_scheme's: prefix
    "k_scale" and "v_scale", or the older k_proj.k_scale / k_proj.output_scale and their v_proj twins), each K or V
    value over its head's: the values as they are, one for every head or one a head (cache/specs.py's
    with_kv_dtype checks them, for an FP8 cache only); () for one the checkpoint lacks; None where it has neither."""
    found = [next((tensors[prefix + name] for name in names if prefix + name in tensors), None)
             for names in KV_SCALE_NAMES]
    if all(t is None for t in found):
        return None
    return tuple(() if t is None else tuple(t.float().flatten().tolist()) for t in found)


# A layer's K and V scale names (after its attention's prefix), the kv_cache_scheme's first.
KV_SCALE_NAMES = (("k_scale", "k_proj.k_scale", "k_proj.output_scale"),
                  ("v_scale", "v_proj.v_scale", "v_proj.output_scale"))
