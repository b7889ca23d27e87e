"""FP8 checkpoints as published (quantization_config quant_method "fp8", e4m3 weights with float32 inverse scales per
block): the engine's logits against transformers loading the same checkpoint dequantized, for a dense model and
DeepSeek's latent attention and experts (and sparse attention's indexer); other schemes refused at load. A weight
keeps its FP8 form (Fp8Weight) through the row picks and stacks of model code. --quantize fp8: a bf16/fp32
checkpoint's linear weights quantized at load, against transformers running those very weights."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.loading.fp8 import Fp8Experts, Fp8Weight, QuantizedTensors, dequantize, is_linear_weight, \
    is_stacked_experts, quantize_experts, quantize_rows
from engine_runs import greedy_logits
from fp8_checkpoints import BLOCK, quantized, write_compressed, write_fp8
from tiny_models import load_reference, restack_experts, write_tiny

def assert_greedy_matches(engine, vocab_size: int, reference, name: str) -> list:
    """The engine's greedy logits and tokens over 8 steps against the reference's on the same tokens (1e-4
    relative, tokens equal); returns the engine's logits."""
    prompt = torch.randint(3, vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, tokens = greedy_logits(engine, prompt, 8)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, len(prompt) - 1:]
    for i, (row, want) in enumerate(zip(ours, expected)):
        assert float((row - want).abs().max() / want.abs().max()) < 1e-4, f"{name}: step {i}"
    assert tokens[len(prompt):] == expected[:-1].argmax(-1).tolist()
    return ours


@pytest.mark.parametrize("name", ["llama3_untied", "deepseek_v3", "deepseek_v32"])
def test_fp8_checkpoints_match_transformers_dequantized(name, tmp_path):
    directory = write_fp8(name, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(weight_block_size=BLOCK, dequantize=True)).eval()
    engine, info = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16))
    assert_greedy_matches(engine, info.vocab_size, reference, name)


@pytest.mark.parametrize("name, strategy", [("llama3_untied", "channel"), ("qwen3", "tensor"),
                                            ("mixtral", "block"), ("deepseek_v3", "channel")])
def test_compressed_tensors_fp8_matches_transformers_reading_it(name, strategy, tmp_path):
    """llm-compressor's FP8 layout, read by transformers itself (its compressed-tensors loader, dequantized):
    greedy logits within 1e-4. The scales are float32 here, so its dequantized weights are exact as ours are."""
    directory = write_compressed(name, tmp_path, strategy)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    ).eval()
    engine, info = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16))
    assert_greedy_matches(engine, info.vocab_size, reference, name)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_scales_as_published_read_exactly(strategy, tmp_path):
    """bfloat16 scales (as the releases have them), static input scales and KV scales beside: each weight reads as
    its e4m3 values times its scale, exactly; the scales and static input scales are not tensors of the model (the KV
    scales are: the FP8 KV cache's). A scale for the whole weight or one a row keeps one scale a row (what the GPU
    multiplies in FP8)."""
    directory = write_compressed("llama3_untied", tmp_path, strategy, torch.bfloat16, static=True, kv_scales=True)
    published = load_file(directory / "model.safetensors")
    tensors = load_checkpoint(directory).tensors
    assert not [key for key in tensors if key.endswith(("weight_scale", "_scale_inv", "input_scale"))]
    assert {key.rsplit(".", 1)[1] for key in published if key not in tensors} == {"weight_scale", "input_scale"}
    assert "model.layers.0.self_attn.k_scale" in tensors and "model.layers.1.self_attn.v_scale" in tensors
    key = "model.layers.1.mlp.down_proj.weight"
    weight, scale = tensors[key], published[key + "_scale"].float()
    assert isinstance(weight, Fp8Weight) and weight.block == (BLOCK[1] if strategy == "block" else weight.shape[1])
    rows, cols = weight.shape
    if strategy == "block":
        scale = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    assert torch.equal(weight.dequantize(), published[key].float() * scale)


def test_fp8_method_with_a_weight_scale_reads_as_its_dequantized_weights(tmp_path):
    """AutoFP8 / vLLM's own serialization (quant_method "fp8", activation_scheme "static"): a weight_scale for the
    whole weight and an input_scale, against transformers running the dequantized weights."""
    directory = write_compressed("llama3_untied", tmp_path / "source", "tensor", static=True)
    published = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    for target, tensors in (("fp8", published), ("dense", {key: t.float() * published[key + "_scale"].float()
                                                           if key + "_scale" in published else t
                                                           for key, t in published.items()
                                                           if not key.endswith(("_scale", "input_scale"))})):
        (tmp_path / target).mkdir()
        save_file(tensors, tmp_path / target / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / target / "config.json").write_text(json.dumps(
            config if target == "fp8" else {k: v for k, v in config.items() if k != "quantization_config"}))
    engine, info = build_engine(load_checkpoint(tmp_path / "fp8"), EngineConfig(device="cpu", kv_blocks=16))
    assert_greedy_matches(engine, info.vocab_size, load_reference(tmp_path / "dense"), "fp8 weight_scale")


def test_weight_only_fp8_and_kv_scales_alone_load(tmp_path):
    """compressed-tensors writes FP8 weights without input quantization as "naive-quantized" (the same tensors),
    and a checkpoint of KV cache scales alone as "dense" (plain weights)."""
    directory = write_compressed("llama3_untied", tmp_path / "naive", "channel")
    config = json.loads((directory / "config.json").read_text())
    quantization = config["quantization_config"]
    quantization["format"] = "naive-quantized"
    del quantization["config_groups"]["group_0"]["input_activations"]
    (directory / "config.json").write_text(json.dumps(config))
    weight = load_checkpoint(directory).tensors["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(weight, Fp8Weight) and weight.block == weight.shape[1]
    dense = write_tiny("llama3_untied", tmp_path / "dense")
    tensors = load_file(dense / "model.safetensors")
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                    "model.layers.0.self_attn.v_scale": torch.tensor(0.25)})
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "symmetric": True, "dynamic": False}}
    (dense / "config.json").write_text(json.dumps(config))
    engine, _ = build_engine(load_checkpoint(dense), EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))
    assert engine.cache.layers[0].scales.flatten().tolist() == [0.5, 0.25]


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path):
    directory = write_compressed("llama_tied", tmp_path, "channel")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match="q_proj.weight is torch.float8_e4m3fn without a scale"):
        build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16))


@pytest.mark.parametrize("name", ["llama3_untied", "qwen3", "mixtral", "deepseek_v3", "hy_v4"])
def test_quantize_fp8_runs_the_checkpoint_as_its_fp8_weights(name, tmp_path):
    """--quantize fp8 against transformers loading the checkpoint with each linear weight (and stacked experts,
    as Hy4's are saved) replaced by its e4m3 values times their row's scale; and visibly apart from the unquantized
    model."""
    source = write_tiny(name, tmp_path / "model")
    tensors = load_file(source / "model.safetensors")
    linear = [key for key, tensor in tensors.items() if is_linear_weight(key, tensor)]
    assert linear and not any("embed" in key or "norm" in key or key.endswith(".gate.weight") for key in linear)
    rounded = tmp_path / "rounded"
    rounded.mkdir()
    save_file({key: quantize_rows(t).dequantize() if key in linear
               else quantize_experts(t).dequantize() if is_stacked_experts(key, t) else t
               for key, t in tensors.items()}, rounded / "model.safetensors", metadata={"format": "pt"})
    (rounded / "config.json").write_text((source / "config.json").read_text())
    engine, info = build_engine(load_checkpoint(source), EngineConfig(device="cpu", kv_blocks=16, quantize="fp8"))
    ours = assert_greedy_matches(engine, info.vocab_size, load_reference(rounded), name)
    plain, _ = build_engine(load_checkpoint(source), EngineConfig(device="cpu", kv_blocks=16))
    prompt = torch.randint(3, info.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    unquantized = greedy_logits(plain, prompt, 0)[0][0]
    assert float((ours[0] - unquantized).abs().max() / unquantized.abs().max()) > 1e-3


def test_quantize_fp8_quantizes_stacked_experts_as_the_same_experts_one_by_one(tmp_path):
    """transformers 5's stacked experts ([experts, rows, columns] under experts.gate_up_proj and experts.down_proj,
    as a model it initialised holds them) quantize row by row as the same experts saved one by one: an Fp8Experts,
    and the same logits."""
    source = write_tiny("qwen3_moe", tmp_path / "model")
    stacked = restack_experts(source, tmp_path / "stacked")
    quantized_tensors = QuantizedTensors(load_checkpoint(stacked).tensors)
    assert isinstance(quantized_tensors["model.layers.0.mlp.experts.down_proj"], Fp8Experts)
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = [greedy_logits(build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16,
                                                                                  quantize="fp8"))[0], prompt, 4)
              for directory in (source, stacked)]
    assert logits[0][1] == logits[1][1] and all(torch.equal(a, b) for a, b in zip(logits[0][0], logits[1][0]))


def test_an_fp8_weight_keeps_its_form_through_row_picks_and_stacks():
    weight = torch.randn(40, 24)
    fp8, scale = quantized(weight, (16, 16))
    blocks, whole = Fp8Weight.of_checkpoint(fp8, scale, (16, 16)), Fp8Weight.of_checkpoint(fp8, scale[:1, :1], None)
    dense = dequantize(fp8, scale, (16, 16))
    assert torch.equal(blocks.dequantize(), dense)
    assert torch.equal(whole.dequantize(), dequantize(fp8, scale[:1, :1].view(()), None))
    ids = torch.tensor([39, 0, 17, 16])
    picked = blocks[ids]
    assert isinstance(picked, Fp8Weight) and torch.equal(picked.dequantize(), dense[ids])
    stacked = torch.cat([blocks, picked])
    assert isinstance(stacked, Fp8Weight) and torch.equal(stacked.dequantize(), torch.cat([dense, dense[ids]]))
    mixed = torch.cat([blocks, whole])                       # blocks of another width: the dense tensors' cat
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([dense, whole.dequantize()]))
    assert torch.equal(blocks.t(), dense.t()) and torch.equal(blocks * torch.tensor(2.0), dense * 2.0)
    for scaled in (blocks * 1.0, 0.5 * blocks):              # a number: still FP8, its scales scaled
        assert isinstance(scaled, Fp8Weight)
    assert torch.equal((blocks * 1.0).dequantize(), dense) and torch.equal((0.5 * blocks).dequantize(), 0.5 * dense)
    assert torch.equal(blocks[:, 3:5], dense[:, 3:5]) and torch.equal(blocks.to(torch.bfloat16), dense.bfloat16())
    with pytest.raises(InvalidArgument, match="does not fit"):
        Fp8Weight(fp8, scale, 16)                            # block scales not yet a row each


def test_quantize_rows_is_e4m3_with_one_scale_a_row():
    weight = torch.randn(6, 40) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [1.0], [2.0]])
    fp8 = quantize_rows(weight)
    assert fp8.data.dtype == torch.float8_e4m3fn and fp8.scales.shape == (6, 1) and fp8.block == 40
    assert torch.equal(fp8.data.float().abs().amax(dim=1)[[0, 1, 2, 4, 5]], torch.full((5,), 448.0))
    assert torch.equal(fp8.dequantize()[3], torch.zeros(40))                    # a row of zeros stays zero
    torch.testing.assert_close(fp8.dequantize(), weight, rtol=0.07, atol=0.0)  # 3 mantissa bits


def test_a_scale_for_the_whole_weight_and_for_blocks():
    weight = torch.randn(40, 24)
    fp8, scale = quantized(weight, (40, 24))                 # one block: one scale
    torch.testing.assert_close(dequantize(fp8, scale.view(()), None), fp8.float() * scale.item())
    fp8, scale = quantized(weight, (16, 16))                 # 40 x 24 in 3 x 2 blocks, the last ones clipped
    restored = dequantize(fp8, scale, (16, 16))
    assert scale.shape == (3, 2) and restored[17, 20] == fp8[17, 20].float() * scale[1, 1]
    assert restored[39, 23] == fp8[39, 23].float() * scale[2, 1]
    torch.testing.assert_close(restored, weight, rtol=0.07, atol=0.0)          # e4m3 keeps 3 mantissa bits
    with pytest.raises(InvalidArgument, match="scales"):
        dequantize(fp8, scale[:, :1], (16, 16))


W4A16 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                          "group_size": 128, "symmetric": True}}}
FP8_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "fmt": "e3m4"}, "'e3m4' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": W4A16},
     "format 'pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": W4A16},
     "weights of 4-bit int are not supported"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {
        "g": {**FP8_GROUP, "weights": {**FP8_GROUP["weights"], "type": "int"}}}}, "weights of 8-bit int"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {**FP8_GROUP, "weights": {**FP8_GROUP["weights"], "strategy": "block"}}}}, "without a block_structure"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": FP8_GROUP},
      "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, "kv_cache_scheme of 8-bit int"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": ["weights"]}},
     "group 'g' must be a JSON object"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}},
     "without a config group of quantized weights"),
    ({"quant_method": "compressed-tensors", "format": "dense", "config_groups": {"g": FP8_GROUP}},
     "format 'dense' with quantized weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {**FP8_GROUP, "weights": {**FP8_GROUP["weights"], "strategy": "group"}}}}, "strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {**FP8_GROUP, "input_activations": {"num_bits": 8, "type": "int"}}}}, "8-bit int are not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "frozen",
      "config_groups": {"g": FP8_GROUP}}, "quantization_status 'frozen'"),
])
def test_other_schemes_are_refused_at_load(tmp_path, quantization, message):
    directory = write_tiny("llama_tied", tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(InvalidArgument, match=message):
        load_checkpoint(directory)


def test_fused_linears_of_fp8_weights_stay_fp8():
    """DeepSeek's fused input linears (models/fused_linear.py) of FP8 parts: one FP8 stack, zero rows padding each
    part to 8 rows."""
    from types import SimpleNamespace
    from metrale.runtime.models.fused_linear import fuse
    parts = {"q": quantize_rows(torch.randn(12, 32)), "latent": quantize_rows(torch.randn(8, 32)),
             "gate": quantize_rows(torch.randn(3, 32))}
    fused = fuse(SimpleNamespace(upload=lambda tensor: tensor), parts)
    assert isinstance(fused.weight, Fp8Weight) and fused.weight.shape == (16 + 8 + 8, 32)
    assert fused.parts == {"q": (0, 12), "latent": (16, 24), "gate": (24, 27)}
    dense = fused.weight.dequantize()
    for name, (start, stop) in fused.parts.items():
        assert torch.equal(dense[start:stop], parts[name].dequantize())
    assert not dense[12:16].any() and not dense[27:].any()
