"""Nemotron-H (and Nemotron-Nano-v2, Nemotron 3 Nano): Mamba2, attention, ReLU² MLP and mixture-of-experts blocks
in the order its config lists them (layers_block_type, or the older hybrid_override_pattern); attention without
rotary positions. Its experts are ReLU² MLPs without a gate, routed as DeepSeek-V3 routes (sigmoid scores, a
correction bias for the choice, groups), beside one shared ReLU² MLP."""

import math

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.hybrid import HybridConfig
from metrale.runtime.models.mamba2_mixer import MixerShape
from metrale.runtime.models.moe import MoeConfig

# Each spelling a checkpoint may use for a layer kind -> ours.
KINDS = {"M": "mamba", "mamba": "mamba", "linear_attention": "mamba",
         "*": "attention", "attention": "attention", "full_attention": "attention",
         "-": "mlp", "mlp": "mlp", "E": "moe", "moe": "moe"}


def layer_kinds(hf: dict) -> tuple[str, ...]:
    listed = hf.get("layers_block_type") or list(hf.get("hybrid_override_pattern") or "")
    unknown = sorted({kind for kind in listed if kind not in KINDS})
    if not listed or unknown:
        raise InvalidArgument(f"NemotronH: layer kinds {unknown or listed} are not understood")
    return tuple(KINDS[kind] for kind in listed)


def moe_config(hf: dict, kinds: tuple[str, ...]) -> MoeConfig | None:
    """The mixture-of-experts layers' shape, where the model has any."""
    layers = tuple(i for i, kind in enumerate(kinds) if kind == "moe")
    if not layers:
        return None
    if hf.get("moe_latent_size") is not None:
        raise InvalidArgument("NemotronH with moe_latent_size (latent expert projections) is not supported")
    return MoeConfig(num_experts=hf.get("n_routed_experts", 8), top_k=hf.get("num_experts_per_tok", 2),
                     width=hf.get("moe_intermediate_size", 7688), layers=layers, scoring="sigmoid",
                     normalize=hf.get("norm_topk_prob", True), correction_bias=True, n_group=hf.get("n_group") or 1,
                     topk_group=hf.get("topk_group") or 1, scaling=hf.get("routed_scaling_factor", 1.0),
                     shared_width=hf.get("moe_shared_expert_intermediate_size", 7688), activation="relu2",
                     module="mixer", expert_names=(None, "up_proj", "down_proj"))


def config_from_hf(hf: dict) -> HybridConfig:
    if hf.get("mlp_hidden_act", "relu2") != "relu2":
        raise InvalidArgument(f"mlp_hidden_act {hf['mlp_hidden_act']!r} is not supported (relu2 is)")
    if hf.get("mamba_hidden_act", "silu") != "silu":
        raise InvalidArgument(f"mamba_hidden_act {hf['mamba_hidden_act']!r} is not supported (silu is)")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    num_heads = hf.get("num_attention_heads", 32)
    mixer = MixerShape(hidden_size=hf["hidden_size"], num_heads=hf.get("mamba_num_heads", 128),
                       head_dim=hf.get("mamba_head_dim", 64), state_size=hf.get("ssm_state_size", 128),
                       n_groups=hf.get("n_groups", 8), conv_kernel=hf.get("conv_kernel", 4),
                       chunk_size=hf.get("chunk_size", 128), norm_eps=eps, in_bias=hf.get("use_bias", False),
                       out_bias=hf.get("use_bias", False),
                       use_conv_bias=hf.get("use_conv_bias", True),
                       # transformers' and mamba_ssm's Nemotron-H mixer: no upper limit, time_step_min below
                       dt_min=hf.get("time_step_min", 0.001), dt_max=math.inf)
    kinds = layer_kinds(hf)
    return HybridConfig.from_hf(
        hf, layer_kinds=kinds, mixer=mixer, norm_eps=eps, num_heads=num_heads, moe=moe_config(hf, kinds),
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf.get("intermediate_size", 0), mlp_bias=hf.get("mlp_bias", False))
