"""Qwen2: the Llama decoder with biases on the q, k and v projections."""

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.llama import DecoderConfig


def config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("use_sliding_window"):
        raise InvalidArgument("Qwen2 with use_sliding_window=true is not supported")
    return DecoderConfig.from_hf(hf, qkv_bias=True)
