"""Rotary embedding frequencies, with the scalings Hugging Face configs name (default, linear, llama3, yarn,
longrope), and the factor some of them scale cos and sin by."""

import math

import torch

from metrale.runtime.errors import InvalidArgument


def rotate_half_order(rope_dim: int) -> torch.Tensor:
    """Interleaved pairs (0, 1), (2, 3), ... as rotate-half's (i, i + rope_dim / 2): the even dims, then the odd.
    A query's and a key's rotary rows reordered alike leave their products unchanged."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def rope_parameters(hf: dict) -> dict:
    """The rope settings of a config.json, old style (rope_theta + rope_scaling) or new (rope_parameters)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
    return params


def inverse_frequencies(params: dict, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32, as transformers computes them."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, params)
    if kind == "yarn":
        return _yarn(params, head_dim)
    if kind == "longrope":
        # The long factors where the model's positions reach past the original context, else the short ones (as
        # transformers chooses them by the sequence's length: the same wherever max_position_embeddings is the
        # original's, as in MiniCPM3).
        long = params["max_position_embeddings"] > params["original_max_position_embeddings"]
        factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        return inv_freq / factors
    raise InvalidArgument(f"rope type {kind!r} is not supported (default, linear, llama3, yarn, longrope are)")


def attention_factor(params: dict) -> float:
    """What yarn and longrope scale cos and sin by (transformers' attention_factor); 1 for the others."""
    kind = params["rope_type"]
    if kind not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _factor(params)
    if kind == "longrope":
        original = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by factor."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _factor(params: dict) -> float:
    """The context's stretch: the config's factor, else max over original max positions."""
    if params.get("factor") is not None:
        return float(params["factor"])
    return params["max_position_embeddings"] / params["original_max_position_embeddings"]


def _yarn(params: dict, head_dim: int) -> torch.Tensor:
    """YaRN: the high frequencies kept, the low ones divided by the factor, a linear ramp between (the dims whose
    wavelength makes beta_fast .. beta_slow turns over the original context)."""
    base, factor = float(params["rope_theta"]), _factor(params)
    original = params.get("original_max_position_embeddings") or params["max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq (times scale: attention_factor()): [max_positions, head_dim // 2] float32
    each."""
    angles = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale
