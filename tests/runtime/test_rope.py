"""Rotary frequencies and their cos/sin scale against transformers' own (ROPE_INIT_FUNCTIONS), for each scaling a
supported config names, at head widths and factors the released models use."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from metrale.runtime.models.rope import attention_factor, inverse_frequencies, rope_parameters

LONG = [1.0 + 0.1 * i for i in range(16)]
SHORT = [1.0 + 0.02 * i for i in range(16)]
CASES = {
    # DeepSeek-V3's: factor 40 over 4k, both mscales (cos/sin unscaled, the softmax scale carries mscale_all_dim).
    "yarn deepseek-v3": (32768 * 5, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                         original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                                         mscale_all_dim=1.0)),
    "yarn mscales apart": (4096, dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=1024, mscale=0.9, mscale_all_dim=0.7)),
    "yarn factor only": (8192, dict(rope_type="yarn", rope_theta=500000.0, factor=8.0,
                                    original_max_position_embeddings=1024)),
    # MiniCPM3's: max positions at the original's (the short factors, scale 1), and past it.
    "longrope at the original": (32768, dict(rope_type="longrope", rope_theta=10000.0, long_factor=LONG,
                                             short_factor=SHORT, original_max_position_embeddings=32768)),
    "longrope past it": (131072, dict(rope_type="longrope", rope_theta=10000.0, long_factor=LONG, short_factor=SHORT,
                                      original_max_position_embeddings=32768)),
    "llama3": (8192, dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=1024)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_scale_match_transformers(case):
    max_positions, params = CASES[case]
    hf = dict(model_type="deepseek_v3", hidden_size=256, num_attention_heads=8, qk_rope_head_dim=32,
              qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=64, max_position_embeddings=max_positions,
              rope_parameters=params)
    config = transformers.AutoConfig.for_model(**hf)
    params = rope_parameters(hf)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu",
                                                                     seq_len=max_positions if "long" in case else None)
    assert torch.allclose(inverse_frequencies(params, 32), want_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor(params) == pytest.approx(float(want_scale), rel=1e-12)
