"""A loaded checkpoint: its Hugging Face style config and its tensors under Hugging Face names."""

from dataclasses import dataclass, field

import torch


@dataclass
class Checkpoint:
    # config.json as a dict: "architectures", "hidden_size", ... (GGUF metadata is mapped to these keys).
    config: dict
    # Hugging Face parameter names ("model.layers.0.self_attn.q_proj.weight") -> tensors, dequantised.
    tensors: dict[str, torch.Tensor]
    # Where it came from, for Info.model_id.
    source: str
    # The model's tokenizer, or None where the checkpoint has none.
    tokenizer: object | None = None
    metadata: dict = field(default_factory=dict)
