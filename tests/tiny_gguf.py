"""Tiny random models written as GGUF files the way llama.cpp's converter writes them, for the tests."""

import re

import gguf
import numpy as np
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from block_bytes import quantize

# HF leaf -> llama.cpp leaf, written out here rather than taken from gguf_file.py, which they test.
HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
# case -> (gguf arch, config class, model class, config overrides). Qwen3's head_dim is its config default
# (128), since transformers ignores qwen3.attention.key_length when it reads a GGUF.
TINY = {
    "llama_tied": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama_untied": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3_rope": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE,
                                                                        max_position_embeddings=16384)),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=128)),
}


def tiny_model(case: str, seed: int = 0, **config):
    """A random transformers model of TINY[case], config overriding its fields."""
    _, config_class, model_class, overrides = TINY[case]
    config = getattr(transformers, config_class)(**{**BASE, **overrides, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # random norms and biases too, so a misplaced tensor shows
            param.normal_(0.0, 0.2)
    return model


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[stem]}.{kind}"
    layer, leaf = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem).groups()
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[leaf]}.{kind}"


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs.
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path, case: str, model, quant=gguf.GGMLQuantizationType.F32, overrides: dict | None = None):
    """model as llama.cpp would write it: its Q/K rows permuted (llama), every 2-D tensor in quant, or in
    overrides[part] where its HF name contains part (a Q4_K_M file's Q6_K down_proj: {"down_proj": Q6_K})."""
    arch = TINY[case][0]
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {case}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        kind = next((kind for part, kind in (overrides or {}).items() if part in name), quant)
        if data.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), quantize(data, kind.name), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), data)
    if config.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp keeps llama3 rope scaling only as per-frequency divisors of the default frequencies.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        default_inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** exponents)
        scaled_inv_freq = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]
        writer.add_tensor("rope_freqs.weight", (default_inv_freq / scaled_inv_freq).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
