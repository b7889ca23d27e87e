"""Mixtral: Mistral's decoder with a mixture of experts (softmax top-k, the chosen weights normalised) in every
layer, each expert as wide as intermediate_size."""

from metrale.runtime.models.llama import DecoderConfig
from metrale.runtime.models.moe import MoeConfig


def config_from_hf(hf: dict) -> DecoderConfig:
    moe = MoeConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    width=hf["intermediate_size"], layers=tuple(range(hf["num_hidden_layers"])),
                    module="block_sparse_moe", stacked_module="mlp", expert_names=("w1", "w3", "w2"))
    return DecoderConfig.from_hf(hf, sliding_window=hf.get("sliding_window"), moe=moe)
