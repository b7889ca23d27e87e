"""dots.llm1: Qwen3's decoder (RMSNorm on q and k heads) with DeepSeek-V3's mixture of experts after its first
first_k_dense_replace dense layers: sigmoid scores, e_score_correction_bias for the choice, top-k within the
topk_group best of n_group groups, routed_scaling_factor, and n_shared_experts experts every token goes through."""

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.llama import DecoderConfig
from metrale.runtime.models.moe import MoeConfig


def config_from_hf(hf: dict) -> DecoderConfig:
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        raise InvalidArgument("dots.llm1 with sliding_attention layers is not supported")
    width = hf["moe_intermediate_size"]
    moe = MoeConfig(num_experts=hf.get("n_routed_experts", hf.get("num_local_experts")),
                    top_k=hf["num_experts_per_tok"], width=width,
                    layers=tuple(range(hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"])),
                    scoring="sigmoid", normalize=hf.get("norm_topk_prob", False), correction_bias=True,
                    n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                    scaling=hf.get("routed_scaling_factor", 1.0),
                    shared_width=width * (hf.get("n_shared_experts") or 0))
    bias = hf.get("attention_bias", False)
    return DecoderConfig.from_hf(hf, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)
