"""Each architecture's logits through the engine (Prefill, then 64 greedy Decode steps) against transformers."""

import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import TINY, TINY_MLA, TINY_MOE, TINY_SPARSE, TINY_SSM, load_reference, write_tiny

NUM_DECODES = 64


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("name", sorted(TINY) + sorted(TINY_MOE) + sorted(TINY_MLA) + sorted(TINY_SPARSE)
                         + sorted(TINY_SSM))
def test_prefill_and_decode_logits_match_transformers(name, tmp_path):
    directory = write_tiny(name, tmp_path / name, shard=name == "llama3_untied")
    reference = load_reference(directory)
    engine, info = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=32))
    prompt = torch.randint(0, info.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    logits_out = OutputOptions(return_logits=True)

    out = engine.step(Step(prefill=(PrefillSlice(7, tuple(prompt), output=logits_out),)))
    ours = [out.outputs[0].logits]
    tokens = list(prompt)
    for _ in range(NUM_DECODES):
        tokens.append(out.outputs[0].token)
        out = engine.step(Step(decode=(DecodeToken(7, tokens[-1]),)))
        ours.append(out.outputs[0].logits)

    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0]     # [len, vocab]
    expected = ref[len(prompt) - 1:]
    assert len(ours) == expected.shape[0] == NUM_DECODES + 1
    for i, (row, want) in enumerate(zip(ours, expected)):
        assert relative_error(row, want) < 1e-4, f"{name}: step {i}"
    # Greedy decoding follows the reference's argmax at every step.
    assert tokens[len(prompt):] == expected[:-1].argmax(-1).tolist()


@pytest.mark.parametrize("name", ["mixtral", "dots1", "nemotron_h_moe", "granite_hybrid_moe"])
def test_stacked_experts_load_as_released_ones(name, tmp_path):
    """transformers 5 holds each layer's experts stacked ([experts, out, in] under experts.gate_up_proj, ...); a
    checkpoint saved that way gives the same logits as the released layout, one tensor per expert."""
    import json

    from metrale.runtime.loading import Checkpoint

    directory = write_tiny(name, tmp_path / name)
    stacked = Checkpoint(config=json.loads((directory / "config.json").read_text()),
                         tensors=load_reference(directory).state_dict(), source="stacked")
    assert any("experts.gate_up_proj" in n or "experts.up_proj" in n for n in stacked.tensors)
    prompt = tuple(range(3, 23))
    logits = []
    for checkpoint in (load_checkpoint(directory), stacked):
        engine, _ = build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=32))
        out = engine.step(Step(prefill=(PrefillSlice(1, prompt, output=OutputOptions(return_logits=True)),)))
        logits.append(out.outputs[0].logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("name, hc_mult", [("hy_v4", 4), ("deepseek_v32", 0), ("deepseek_v3", 0)])
def test_info_reports_the_hyper_connection_streams(name, hc_mult, tmp_path):
    _, info = build_engine(load_checkpoint(write_tiny(name, tmp_path / name)), EngineConfig(device="cpu", kv_blocks=8))
    assert (info.hc_mult, info.is_mla) == (hc_mult, True)


def test_hy4_without_indexer_types_takes_transformers_default(tmp_path):
    """An indexer in the first layer and every fourth from the second, as HYV4Config fills in where config.json
    gives none; the layers between reuse the last one's choice (no index key cache of their own)."""
    import json

    from metrale.runtime.models import hy_v4

    config = json.loads((write_tiny("hy_v4", tmp_path / "hy") / "config.json").read_text())
    config.pop("indexer_types")
    config.update(num_hidden_layers=10, mlp_layer_types=None, layer_types=None)
    assert hy_v4.config_from_hf(config).indexer.layers == (0, 1, 5, 9)
