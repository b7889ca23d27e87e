"""Nemotron-H (and Nemotron-Nano-v2): Mamba2, attention and ReLU² MLP blocks in the order its config lists them
(layers_block_type, or the older hybrid_override_pattern); attention without rotary positions."""

import math

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.hybrid import HybridConfig
from metrale.runtime.models.mamba2_mixer import MixerShape

# Each spelling a checkpoint may use for a layer kind -> ours.
KINDS = {"M": "mamba", "mamba": "mamba", "linear_attention": "mamba",
         "*": "attention", "attention": "attention", "full_attention": "attention",
         "-": "mlp", "mlp": "mlp", "E": "moe", "moe": "moe"}


def layer_kinds(hf: dict) -> tuple[str, ...]:
    listed = hf.get("layers_block_type") or list(hf.get("hybrid_override_pattern") or "")
    unknown = sorted({kind for kind in listed if kind not in KINDS})
    if not listed or unknown:
        raise InvalidArgument(f"NemotronH: layer kinds {unknown or listed} are not understood")
    kinds = tuple(KINDS[kind] for kind in listed)
    if "moe" in kinds:
        raise InvalidArgument("NemotronH with mixture-of-experts layers is not supported yet (its dense layer "
                              "kinds are: Mamba2, attention, MLP)")
    return kinds


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
    return HybridConfig.from_hf(
        hf, layer_kinds=layer_kinds(hf), mixer=mixer, norm_eps=eps, num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf.get("intermediate_size", 0), mlp_bias=hf.get("mlp_bias", False))
