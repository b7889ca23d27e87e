"""Tiny FP8 checkpoints as the releases publish them, for the FP8 tests on both backends: quant_method "fp8" with block
scales (write_fp8, DeepSeek's and Qwen3's layout) and llm-compressor's compressed-tensors (write_compressed)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_models import write_tiny

E4M3_MAX = 448.0
# Unequal, and dividing every tiny weight: transformers' load-time dequantization takes a block as the weight over its
# scale grid, where the releases' grid is ceil(weight / block) with the last blocks clipped (as ours reads it,
# test_a_scale_for_the_whole_weight_and_for_blocks).
BLOCK = (16, 8)


def quantized(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 [out, in], float32 inverse scales [ceil(out / block[0]), ceil(in / block[1])]),
    each block scaled to the format's range, as the FP8 releases are."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:rows, :cols].contiguous()
    return fp8, scale


def write_fp8(name: str, directory: Path, block: tuple[int, int] = BLOCK, **widths) -> Path:
    """The tiny checkpoint (write_tiny's widths) with every linear's weight (not the embedding, LM head, norms or
    routers) in FP8."""
    source = write_tiny(name, directory / "bf16", **widths)
    tensors, out = load_file(source / "model.safetensors"), {}
    for key, tensor in tensors.items():
        linear = tensor.dim() == 2 and key.endswith("proj.weight") or "proj_with_mqa" in key
        if linear:
            out[key], out[key + "_scale_inv"] = quantized(tensor, block)
        else:
            out[key] = tensor
    target = directory / "fp8"
    target.mkdir()
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (target / "config.json").write_text(json.dumps(config))
    return target


def write_compressed(name: str, directory: Path, strategy: str, scale_dtype=torch.float32, static: bool = False,
                     kv_scales: bool = False) -> Path:
    """The tiny checkpoint as llm-compressor publishes FP8 (quant_method "compressed-tensors", format
    "float-quantized"): each linear's weight e4m3 with a weight_scale by tensor, channel or block (BLOCK); inputs
    quantized per token at run time, or (static) with an input_scale each; with kv_scales, a k_scale and v_scale
    per attention layer (a kv_cache_scheme)."""
    source = write_tiny(name, directory / "bf16")
    tensors, out = load_file(source / "model.safetensors"), {}
    for key, tensor in tensors.items():
        if tensor.dim() == 2 and key.endswith("proj.weight"):
            rows, cols = tensor.shape
            block = {"tensor": (rows, cols), "channel": (1, cols), "block": BLOCK}[strategy]
            out[key], scale = quantized(tensor, block)
            out[key + "_scale"] = (scale.reshape(1) if strategy == "tensor" else scale).to(scale_dtype)
            if static:
                out[key.removesuffix("weight") + "input_scale"] = torch.tensor([0.02], dtype=scale_dtype)
        else:
            out[key] = tensor
        if kv_scales and key.endswith("self_attn.k_proj.weight"):
            out[key.removesuffix("k_proj.weight") + "k_scale"] = torch.tensor(0.5, dtype=scale_dtype)
            out[key.removesuffix("k_proj.weight") + "v_scale"] = torch.tensor(0.25, dtype=scale_dtype)
    target = directory / "compressed"
    target.mkdir()
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "block_structure": list(BLOCK) if strategy == "block" else None}
    inputs = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token", "symmetric": True,
              "dynamic": not static}
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                            "dynamic": False} if kv_scales else None}
    (target / "config.json").write_text(json.dumps(config))
    return target
