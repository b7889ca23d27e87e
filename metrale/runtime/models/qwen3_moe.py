"""Qwen3-MoE: Qwen3's decoder with a mixture of experts (softmax top-k, norm_topk_prob) in every
decoder_sparse_step-th layer not in mlp_only_layers; the others keep a dense MLP of intermediate_size."""

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.llama import DecoderConfig
from metrale.runtime.models.moe import MoeConfig


def config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("use_sliding_window"):
        raise InvalidArgument("Qwen3-MoE with use_sliding_window=true is not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(hf["num_hidden_layers"]) if experts > 0 and i not in dense and (i + 1) % step == 0)
    moe = MoeConfig(num_experts=experts, top_k=hf["num_experts_per_tok"], width=hf["moe_intermediate_size"],
                    layers=layers, normalize=hf.get("norm_topk_prob", False)) if layers else None
    bias = hf.get("attention_bias", False)
    return DecoderConfig.from_hf(hf, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)
