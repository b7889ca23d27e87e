"""load_gguf against transformers on the default model, and round trips of tiny GGUFs written here."""

import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from metrale.runtime import errors
from metrale.runtime.loading.gguf_file import load_gguf
from metrale.runtime.tokenizer import Tokenizer

# HF leaf -> llama.cpp leaf, written out here rather than taken from the module under test.
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


def _assert_within_1e6(ours: torch.Tensor, expected: torch.Tensor, name: str):
    # torch.testing.assert_close takes ~20 s over the default model's tensors; this takes well under 1 s.
    assert ours.shape == expected.shape and ours.dtype == expected.dtype, name
    assert torch.equal(ours, expected) or (ours - expected).abs().max().item() <= 1e-6, name


@pytest.fixture(scope="module")
def default_checkpoint(default_gguf):
    return load_gguf(default_gguf)


@pytest.fixture(scope="module")
def reference_model(default_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name).eval()


def test_default_config_matches_transformers(default_checkpoint, reference_model):
    ours, theirs = default_checkpoint.config, reference_model.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == theirs.model_type
    for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]:
        assert ours[key] == getattr(theirs, key), key
    assert ours["rms_norm_eps"] == theirs.rms_norm_eps
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["rope_scaling"] is None and theirs.rope_parameters["rope_type"] == "default"


def test_default_tensors_match_transformers(default_checkpoint, reference_model):
    expected = reference_model.state_dict()
    ours = default_checkpoint.tensors
    # Tied: transformers lists lm_head.weight as the embedding; we leave it out.
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        _assert_within_1e6(tensor, expected[name], name)


def test_default_checkpoint_carries_tokenizer(default_checkpoint):
    tokenizer = default_checkpoint.tokenizer
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == default_checkpoint.config["vocab_size"]
    assert tokenizer.eos_token_ids == [default_checkpoint.config["eos_token_id"]]
    assert "tokenizer.ggml.tokens" not in default_checkpoint.metadata
    assert default_checkpoint.metadata["general.architecture"] == "llama"


def _tiny_model(case: str, seed: int = 0):
    _, config_class, model_class, overrides = TINY[case]
    config = getattr(transformers, config_class)(**{**BASE, **overrides})
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


def _write_tiny_gguf(path, case: str, model, quant=gguf.GGMLQuantizationType.F32):
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
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(data, quant), raw_dtype=quant)
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


@pytest.mark.parametrize("case", sorted(TINY))
def test_tiny_gguf_loads_back_to_the_original(tmp_path, case):
    model = _tiny_model(case)
    path = _write_tiny_gguf(tmp_path / f"{case}.gguf", case, model)
    checkpoint = load_gguf(path)

    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(checkpoint.tensors) == set(expected)
    for name, tensor in checkpoint.tensors.items():
        _assert_within_1e6(tensor, expected[name], name)

    config, reference = checkpoint.config, model.config
    assert config["architectures"] == [TINY[case][2]]
    assert config["model_type"] == reference.model_type
    for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"]:
        assert config[key] == getattr(reference, key), key
    assert config["head_dim"] == (getattr(reference, "head_dim", None) or 16)  # 16: hidden_size / heads
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert config["attention_bias"] == (case == "qwen2")
    if case == "llama3_rope":
        assert config["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    else:
        assert config["rope_scaling"] is None


@pytest.mark.parametrize("case", ["llama_untied", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_tiny_gguf_matches_transformers(tmp_path, case, quant):
    path = _write_tiny_gguf(tmp_path / f"{case}.gguf", case, _tiny_model(case), gguf.GGMLQuantizationType[quant])
    ours = load_gguf(path).tensors
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if "lm_head.weight" not in ours else set())
    for name, tensor in ours.items():
        _assert_within_1e6(tensor, theirs[name], name)


def test_dtype_converts_after_dequantising(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama_tied", _tiny_model("llama_tied"))
    full, half = load_gguf(path).tensors, load_gguf(path, dtype=torch.bfloat16).tensors
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name


def test_unsupported_architecture_is_invalid_argument(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(errors.InvalidArgument, match="architecture 'gpt2' is not supported"):
        load_gguf(path)
