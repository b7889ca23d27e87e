"""load_gguf against transformers on the default model, and round trips of tiny GGUFs (tests/tiny_gguf.py)."""

import gguf
import numpy as np
import pytest
import torch
import transformers

from metrale.runtime import errors
from metrale.runtime.loading.gguf_file import load_gguf
from metrale.runtime.tokenizer import Tokenizer
from tiny_gguf import LLAMA3_ROPE, TINY, tiny_model, write_tiny_gguf


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


@pytest.mark.parametrize("case", sorted(TINY))
def test_tiny_gguf_loads_back_to_the_original(tmp_path, case):
    model = tiny_model(case)
    path = write_tiny_gguf(tmp_path / f"{case}.gguf", case, model)
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
    path = write_tiny_gguf(tmp_path / f"{case}.gguf", case, tiny_model(case), gguf.GGMLQuantizationType[quant])
    ours = load_gguf(path).tensors
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if "lm_head.weight" not in ours else set())
    for name, tensor in ours.items():
        _assert_within_1e6(tensor, theirs[name], name)


def test_dtype_converts_after_dequantising(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_tied", tiny_model("llama_tied"))
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
