"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantized against transformers loading the same
file, and served from its blocks against itself dequantized."""

import pytest
import torch
import transformers

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.step import PrefillSlice, Step
from engine_runs import blocks_tolerance, forced_logits, greedy_logits, relative_error

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(default_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoint(default_gguf):
    return load_checkpoint(default_gguf)


@pytest.fixture(scope="module")
def engine_and_tokenizer(checkpoint):
    """Dequantized to float32, as transformers reads the file."""
    engine, _ = build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=64, dequantize=True))
    return engine, checkpoint.tokenizer


def test_logits_match_transformers_on_the_same_gguf(reference, engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    prompt = tokenizer.encode("Gravity is the force that")
    ours, tokens = greedy_logits(engine, prompt, 8)
    engine.release([1])
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, len(prompt) - 1:]
    for i, (row, want) in enumerate(zip(ours, expected)):
        error = float((row - want).abs().max() / want.abs().max())
        assert error < 1e-3, f"step {i}: relative error {error}"
    assert tokens[len(prompt):] == expected[:-1].argmax(-1).tolist()


def test_greedy_continuation_is_paris(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    out = engine.step(Step(prefill=(PrefillSlice(2, tuple(tokenizer.encode(PROMPT))),)))
    engine.release([2])
    assert tokenizer.decode([out.outputs[0].token]) == " Paris"


def test_blocks_stay_within_the_bf16_models_distance_of_float32(checkpoint, engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    prompt = tokenizer.encode("Gravity is the force that")
    reference, tokens = greedy_logits(engine, prompt, 8)
    engine.release([1])
    blocks_engine, _ = build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=64))
    bf16_engine, _ = build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=64, dequantize=True,
                                                           dtype="bfloat16"))
    blocks, _ = forced_logits(blocks_engine, prompt, tokens[len(prompt):])
    bf16, _ = forced_logits(bf16_engine, prompt, tokens[len(prompt):])
    assert max(relative_error(blocks, reference)) <= blocks_tolerance(bf16, reference)
    out = blocks_engine.step(Step(prefill=(PrefillSlice(2, tuple(tokenizer.encode(PROMPT))),)))
    assert tokenizer.decode([out.outputs[0].token]) == " Paris"
