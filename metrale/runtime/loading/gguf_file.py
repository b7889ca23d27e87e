"""Load a GGUF file as a Checkpoint: HF config from its metadata, tensors under HF names (2-D weights of the kinds
with groups of 32, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q8_0, kept in their blocks, gguf_blocks.py; the others
dequantised)."""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from metrale.runtime import errors
from metrale.runtime.loading.checkpoint import Checkpoint
from metrale.runtime.loading.gguf_blocks import BlockWeight, kind_of
from metrale.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class GgufArchitecture:
    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders Q/K rows of these for its interleaved rope; loading undoes it.
    permuted_qk: bool


# general.architecture -> what it is in Hugging Face terms.
ARCHITECTURES = {
    "llama": GgufArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GgufArchitecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": GgufArchitecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

# GGUF tensor name -> HF tensor name, outside the layers.
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# "blk.N.<gguf>" -> "model.layers.N.<hf>"; .weight and .bias both map.
LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Tensors llama.cpp writes for itself that have no HF parameter; their content goes into the config.
NON_PARAMETER_TENSORS = {"rope_freqs.weight"}

# Tokenizer arrays: large, and carried by Checkpoint.tokenizer, so kept out of Checkpoint.metadata.
TOKENIZER_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores"}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """dtype: of the tensors dequantised here; BlockWeights dequantize to float32 when a tensor is asked of them."""
    reader = GGUFReader(str(path))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    arch_name = fields.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise errors.InvalidArgument(
            f"{path}: GGUF architecture {arch_name!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[arch_name]
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _config(fields, arch_name, arch, gguf_tensors)

    tensors = {}
    for name, tensor in gguf_tensors.items():
        if name in NON_PARAMETER_TENSORS:
            continue
        weight = _read(tensor, path)
        if arch.permuted_qk and name.endswith((".attn_q.weight", ".attn_q.bias")):
            weight = _unpermute_rows(weight, config["num_attention_heads"])
        elif arch.permuted_qk and name.endswith((".attn_k.weight", ".attn_k.bias")):
            weight = _unpermute_rows(weight, config["num_key_value_heads"])
        if isinstance(weight, np.ndarray):
            # np.array copies: an F32 tensor would otherwise alias the read-only memory map.
            weight = torch.from_numpy(np.array(weight, dtype=np.float32, order="C")).to(dtype)
        tensors[_hf_name(name, path)] = weight

    metadata = {key: value for key, value in fields.items() if key not in TOKENIZER_ARRAYS}
    tokenizer = None
    if "tokenizer.ggml.model" in fields:
        try:
            tokenizer = Tokenizer.from_gguf_fields(fields)
        except errors.InvalidArgument as error:
            # The model still serves token ids; only Tokenize/Detokenize/Generate lose their tokenizer.
            metadata["tokenizer_unsupported"] = str(error)
    return Checkpoint(config=config, tensors=tensors, source=str(path), tokenizer=tokenizer, metadata=metadata)


def _config(fields: dict, arch_name: str, arch: GgufArchitecture, gguf_tensors: dict) -> dict:
    """config.json-style dict from the metadata, the way transformers reads the same file."""
    def key(name, default=None):
        return fields.get(f"{arch_name}.{name}", default)

    required = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
    if missing := [name for name in required if key(name) is None]:
        raise errors.InvalidArgument(f"GGUF metadata lacks {[f'{arch_name}.{name}' for name in missing]}")
    hidden_size, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    # key_length where the file states it (qwen3); else the rotary width, which is the whole head in
    # these families (transformers reads llama's head_dim from it too).
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab_size is None:
        vocab_size = gguf_tensors["token_embd.weight"].shape[-1]
    has_bias = any(name.endswith((".attn_q.bias", ".attn_k.bias", ".attn_v.bias")) for name in gguf_tensors)
    rope_theta = float(key("rope.freq_base", 10000.0))
    rope_freqs = gguf_tensors.get("rope_freqs.weight")

    def token_id(name):
        value = fields.get(f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    return {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(fields, arch_name, rope_theta, int(head_dim), rope_freqs),
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in gguf_tensors,
        "hidden_act": "silu",
        "attention_bias": has_bias,
        "mlp_bias": any(name.endswith(".ffn_up.bias") for name in gguf_tensors),
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
    }


def _rope_scaling(fields: dict, arch_name: str, rope_theta: float, head_dim: int, rope_freqs) -> dict | None:
    """HF rope_scaling from rope.scaling.* metadata, or from a llama3-style rope_freqs tensor."""
    scaling_type = fields.get(f"{arch_name}.rope.scaling.type", "none")
    factor = fields.get(f"{arch_name}.rope.scaling.factor")
    original = fields.get(f"{arch_name}.rope.scaling.original_context_length")
    if scaling_type == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn" and factor:
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if scaling_type not in ("none", "linear", "yarn"):
        raise errors.InvalidArgument(f"GGUF rope scaling type {scaling_type!r} is not supported")
    if rope_freqs is None:
        return None
    return _llama3_scaling(dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1), rope_theta, head_dim)


def _llama3_scaling(rope_factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """llama.cpp stores Llama 3.1's rope scaling only as per-frequency factors. The converter computes them
    with low/high_freq_factor 1/4 and an original context of 8192 (every Llama 3.x); check they match."""
    scaling = {"rope_type": "llama3", "factor": float(rope_factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    factor, low, high, old = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings"))
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if expected.shape != rope_factors.shape or not np.allclose(expected, rope_factors, rtol=1e-4):
        raise errors.InvalidArgument("GGUF rope_freqs tensor does not match Llama 3 rope scaling; not supported")
    return scaling


def _read(tensor, path) -> BlockWeight | np.ndarray:
    """A 2-D weight of a kind in gguf_blocks.KINDS in its blocks; any other tensor dequantised."""
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    kind = kind_of(tensor.tensor_type, shape)
    if kind is None:
        return _dequantize(tensor, path)
    return BlockWeight.from_gguf(kind, np.asarray(tensor.data), *shape)


def _dequantize(tensor, path) -> np.ndarray:
    """[out, in] float32 (GGUF lists dims innermost first; numpy order is already HF's)."""
    try:
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping dominates dequantisation time.
        weight = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as error:
        raise errors.InvalidArgument(
            f"{path}: tensor {tensor.name} has quantisation type {tensor.tensor_type.name}, "
            f"which cannot be dequantised ({error})") from error
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    return weight.reshape(shape).astype(np.float32, copy=False)


def _unpermute_rows(weight: BlockWeight | np.ndarray, num_heads: int) -> BlockWeight | np.ndarray:
    """Undo llama.cpp's permute: per head, rows [r0, r_half, r1, r_half+1, ...] -> [r0, r1, ..., r_half, ...]."""
    # rows: [num_heads * head_dim] stored as [num_heads, head_dim / 2, 2]
    num_rows = weight.shape[0]
    order = np.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(weight, BlockWeight):
        return weight.select_rows(torch.from_numpy(order))
    return weight[order]


def _hf_name(gguf_name: str, path) -> str:
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_TENSOR_NAMES:
        raise errors.InvalidArgument(f"{path}: GGUF tensor {gguf_name!r} has no Hugging Face counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[part]}.{kind}"
