"""Mamba2ForCausalLM: a stack of Mamba2 blocks only (the hybrid stack with every layer a Mamba2 mixer); its dt limit
from time_step_limit."""

import math

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.hybrid import HybridConfig
from metrale.runtime.models.mamba2_mixer import MixerShape, hf_float


def config_from_hf(hf: dict) -> HybridConfig:
    hidden = hf["hidden_size"]
    num_heads, head_dim = hf["num_heads"], hf.get("head_dim", 64)
    if hidden * hf.get("expand", 2) != num_heads * head_dim:
        raise InvalidArgument(f"hidden_size * expand ({hidden * hf.get('expand', 2)}) is not num_heads * head_dim "
                              f"({num_heads * head_dim})")
    if hf.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    dt_min, dt_max = (hf_float(v) for v in hf.get("time_step_limit", (0.0, math.inf)))
    eps = hf.get("layer_norm_epsilon", 1e-5)
    shape = MixerShape(hidden_size=hidden, num_heads=num_heads, head_dim=head_dim,
                       state_size=hf.get("state_size", 128), n_groups=hf.get("n_groups", 8),
                       conv_kernel=hf.get("conv_kernel", 4), chunk_size=hf.get("chunk_size", 256), norm_eps=eps,
                       in_bias=hf.get("use_bias", False), out_bias=hf.get("use_bias", False),
                       use_conv_bias=hf.get("use_conv_bias", True),
                       dt_min=dt_min, dt_max=dt_max)
    return HybridConfig.from_hf(hf, layer_kinds=("mamba",) * hf["num_hidden_layers"], mixer=shape, norm_eps=eps)
