"""Mistral: the Llama decoder with an optional sliding attention window."""

from metrale.runtime.models.llama import DecoderConfig


def config_from_hf(hf: dict) -> DecoderConfig:
    return DecoderConfig.from_hf(hf, sliding_window=hf.get("sliding_window"))
