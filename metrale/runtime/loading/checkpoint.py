"""A loaded checkpoint: its Hugging Face style config and its tensors under Hugging Face names."""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class Checkpoint:
    # config.json as a dict: "architectures", "hidden_size", ... (GGUF metadata is mapped to these keys).
    config: dict
    # Hugging Face parameter names ("model.layers.0.self_attn.q_proj.weight") -> tensors, dequantised. A mapping
    # that may read each tensor only when it is taken (safetensors files): take each once, and keep none.
    tensors: Mapping[str, torch.Tensor]
    # Where it came from, for Info.model_id.
    source: str
    # The model's tokenizer, or None where the checkpoint has none.
    tokenizer: object | None = None
    metadata: dict = field(default_factory=dict)

    def numel(self, name: str) -> int:
        """Elements of tensor `name`, without reading it where its mapping can say (SafetensorsFiles)."""
        return math.prod(shape_of(self.tensors, name))


def shape_of(tensors: Mapping, name: str) -> tuple[int, ...]:
    """tensors[name]'s shape, without reading the tensor where the mapping can say (SafetensorsFiles)."""
    shape = getattr(tensors, "shape", None)
    return shape(name) if shape is not None else tuple(tensors[name].shape)
