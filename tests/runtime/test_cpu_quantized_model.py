"""Tiny GGUF llamas served from their quantized blocks against the same files dequantized to float32 (--dequantize):
logits within the tolerance docs/architecture.md derives (the bfloat16 model's distance from float32), greedy
tokens equal where the reference's choice is clear; and --dequantize exactly as a checkpoint dequantized at load."""

import gguf
import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import Checkpoint, load_checkpoint
from metrale.runtime.loading.gguf_blocks import BlockWeight
from engine_runs import blocks_tolerance, forced_logits, greedy_logits, relative_error
from tiny_gguf import tiny_model, write_tiny_gguf

PROMPT = list(range(3, 11))
STEPS = 32
# A tiny model whose rows are whole K super-blocks of 256.
K_SIZES = dict(hidden_size=256, intermediate_size=512)
# file -> (the kind of its 2-D weights, kinds of some of them): "Q4_K_M" as llama.cpp's, with Q6_K weights (groups
# of 16) dequantized at load.
FILES = {quant: (quant, {}) for quant in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"]} | {
    "Q4_K_M": ("Q4_K", {"down_proj": "Q6_K", "lm_head": "Q6_K"})}


def _engine(checkpoint: Checkpoint, **config):
    return build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=16, **config))[0]


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("case, config", [("llama_tied", dict(vocab_size=120)),    # LM head rows padded to 128
                                          ("llama_untied", {})])
def test_blocks_stay_within_the_bf16_models_distance_of_float32(tmp_path, file, case, config):
    quant, overrides = FILES[file]
    sizes = K_SIZES if quant.endswith("_K") else {}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", case, tiny_model(case, **config, **sizes),
                           gguf.GGMLQuantizationType[quant],
                           {part: gguf.GGMLQuantizationType[kind] for part, kind in overrides.items()})
    checkpoint = load_checkpoint(path)
    reference, tokens = greedy_logits(_engine(checkpoint, dequantize=True), PROMPT, STEPS)
    continuation = tokens[len(PROMPT):]
    blocks, chosen = forced_logits(_engine(checkpoint), PROMPT, continuation)
    bf16, _ = forced_logits(_engine(checkpoint, dequantize=True, dtype="bfloat16"), PROMPT, continuation)
    tolerance = blocks_tolerance(bf16, reference)
    assert max(relative_error(blocks, reference)) <= tolerance
    # Each logit within tolerance x max |reference logit|: a top-2 margin over twice that cannot flip.
    reference = torch.stack(reference)
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] > 2 * tolerance * reference.abs().amax(-1)).tolist()
    assert sum(clear) >= STEPS // 4
    expected = reference.argmax(-1).tolist()
    assert [token for token, c in zip(chosen, clear) if c] == [token for token, c in zip(expected, clear) if c]


def test_dequantize_is_a_checkpoint_dequantized_at_load(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_untied", tiny_model("llama_untied"),
                           gguf.GGMLQuantizationType.Q4_1)
    checkpoint = load_checkpoint(path)
    dense = Checkpoint(checkpoint.config, {name: tensor.dequantize() if isinstance(tensor, BlockWeight) else tensor
                                           for name, tensor in checkpoint.tensors.items()}, checkpoint.source)
    ours, tokens = greedy_logits(_engine(checkpoint, dequantize=True), PROMPT, 8)
    expected, expected_tokens = greedy_logits(_engine(dense), PROMPT, 8)
    assert tokens == expected_tokens and all(torch.equal(a, b) for a, b in zip(ours, expected))
