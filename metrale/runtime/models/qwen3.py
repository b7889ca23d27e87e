"""Qwen3: the Llama decoder with RMSNorm on each head of q and k before the rotary embedding."""

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.llama import DecoderConfig


def config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("use_sliding_window"):
        raise InvalidArgument("Qwen3 with use_sliding_window=true is not supported")
    bias = hf.get("attention_bias", False)
    return DecoderConfig.from_hf(hf, qkv_bias=bias, o_bias=bias, qk_norm=True)
