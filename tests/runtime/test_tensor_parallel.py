"""Tensor parallel on the CPU backend: ranks in processes of their own, joined over gloo, each holding its shard of
a tiny checkpoint, give the tokens and logits of the one-device engine (and so of transformers, test_models.py)."""

import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.runtime.build import build_engine, build_follower
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, HEADS, ROWS, Segments, ShardedTensors
from fp8_checkpoints import write_fp8
from tensor_parallel_rank import CONFIG, steps
from tiny_models import restack_experts, write_tiny, write_tiny_m2m100

RANK_SCRIPT = Path(__file__).parents[1] / "tensor_parallel_rank.py"
# The ranks import this checkout's package, whichever one pip installed.
RANK_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory: Path, size: int, out: Path, *extra: str) -> tuple[dict, list[int]]:
    """Rank 0's saved outcome and every rank's exit status."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(directory), str(rank), str(size), str(port),
                               str(out), *extra], stderr=subprocess.PIPE, text=True, env=RANK_ENV)
             for rank in range(size)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert ranks[0].returncode == 0, errors[0][-3000:]
    return torch.load(out), [rank.returncode for rank in ranks]


# What each family's plan splits, two ranks against one device:
# - Llama's: heads 4 and KV heads 2 split in two, or one KV head that both ranks hold; tied and untied embeddings
#   (the LM head's vocabulary split, the embedding whole); row-split biases (added once); Qwen3's per-head norms;
#   Mistral's window.
# - mixtures: each expert's width (Mixtral's w1 / w3 / w2; Qwen3-MoE with a dense layer among them, its experts also
#   stacked as transformers 5 holds them; dots.llm1's grouped sigmoid router and shared experts).
# - M2M100's encoder and decoder: self- and cross-attention heads, feed-forward widths, biased projections.
# - Mamba2 mixers: in_proj's and the conv's segments by heads and groups, the scan's and the gated norm's per-head
#   tensors, the states a rank's heads'; alone, among Nemotron-H's attention, ReLU² MLP and ReLU² experts, and beside
#   Falcon-H1's attention (its µP multipliers folded into each rank's part; as released, one group of B and C, which
#   every rank then holds), and among Granite 4.0-H's attention, shared MLP and stacked experts (at two groups: as
#   released, its one group's gated norm would span the ranks).
# - latent attention by query heads, the latent whole on every rank: DeepSeek-V2-Lite's direct query, V2's and V3's
#   low-rank one with their routers, MiniCPM3's dense layers and scalings, V3.2's sparse attention (the indexer whole,
#   so every rank chooses the same tokens), Hy4's gates, sinks and hyper-connections (whole).
WIDTHS = {"granite_hybrid": dict(mamba_n_groups=2), "granite_hybrid_moe": dict(mamba_n_groups=2)}


@pytest.mark.parametrize("name", [
    "llama_tied", "llama3_untied", "llama_attention_bias", "qwen2", "qwen3", "mistral",
    "mixtral", "qwen3_moe", "qwen3_moe stacked", "dots1",
    "m2m100",
    "mamba2", "nemotron_h", "nemotron_h_moe", "falcon_h1", "falcon_h1_tied", "granite_hybrid", "granite_hybrid_moe",
    "deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "minicpm3", "deepseek_v32", "hy_v4"])
def test_two_ranks_give_the_one_device_tokens_and_logits(name, tmp_path):
    family, _, stacked = name.partition(" ")
    directory = (write_tiny_m2m100(tmp_path / family) if family == "m2m100"
                 else write_tiny(family, tmp_path / family, **WIDTHS.get(family, {})))
    if stacked:
        directory = restack_experts(directory, tmp_path / "stacked")
    tensor_parallel, codes = run_ranks(directory, 2, tmp_path / "rank0.pt")
    assert codes == [0, 0]
    engine, _ = build_engine(load_checkpoint(directory), CONFIG)
    tokens, logits = steps(engine)
    assert tensor_parallel["tokens"] == tokens
    for i, (ours, want) in enumerate(zip(tensor_parallel["logits"], logits)):
        assert ours.shape == want.shape
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-5, f"output {i}"


def test_an_fp8_kv_cache_takes_each_rank_s_heads_scales(tmp_path):
    """k_scale / v_scale a KV head (one layer) and one for all (the other): each rank's cache holds its own heads'
    scales, and the tokens and logits are the one device's with the same FP8 cache."""
    directory = write_tiny("qwen2", tmp_path / "qwen2")                       # 2 KV heads
    tensors = load_file(directory / "model.safetensors")
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor([0.003, 0.5]),
                    "model.layers.0.self_attn.v_scale": torch.tensor([0.05, 0.004]).view(2, 1, 1),
                    "model.layers.1.self_attn.k_scale": torch.tensor(0.004),
                    "model.layers.1.self_attn.v_scale": torch.tensor([0.03])})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = replace(CONFIG, kv_dtype="fp8")
    f32 = torch.tensor([[0.003, 0.05], [0.5, 0.004], [0.004, 0.03]]).tolist()          # as the checkpoint holds them
    for rank in (0, 1):
        specs = build_follower(load_checkpoint(directory), config, ShardOnly(rank, 2))[2]
        assert [specs[0].scales, specs[1].scales] == [((f32[rank][0],), (f32[rank][1],)), ((f32[2][0],), (f32[2][1],))]
    tensor_parallel, codes = run_ranks(directory, 2, tmp_path / "rank0.pt", "kv_dtype=fp8")
    assert codes == [0, 0]
    tokens, logits = steps(build_engine(load_checkpoint(directory), config)[0])
    assert tensor_parallel["tokens"] == tokens
    for i, (ours, want) in enumerate(zip(tensor_parallel["logits"], logits)):
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-5, f"output {i}"


def test_a_forward_that_fails_partway_on_one_rank_fails_that_step_alone(tmp_path):
    """Rank 1's model raises in its third forward, after that forward's first collective (a bug there): rank 0's
    step fails alone (CollectiveFailed, a StepFailed: what it changed is undone), every rank leaves that forward's
    collectives and they make new ones, and the step run again gives the one device's tokens and logits, as does
    every step after it."""
    directory = write_tiny("llama_tied", tmp_path / "llama_tied")
    outcome, codes = run_ranks(directory, 2, tmp_path / "rank0.pt", "fail=3")
    assert codes == [0, 0] and outcome["failures"] == ["CollectiveFailed"]
    tokens, logits = steps(build_engine(load_checkpoint(directory), CONFIG)[0])
    assert outcome["tokens"] == tokens
    for i, (ours, want) in enumerate(zip(outcome["logits"], logits)):
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-5, f"output {i}"


def test_a_rank_that_dies_fails_the_step_as_a_lost_rank(tmp_path):
    """Rank 1 ends at rank 0's fourth call (after the cache, the warm-up and the first prefill): rank 0's next
    step gets RankLost (a DeviceFault: the worker stops serving), not a hang and not a bug's StepFailed."""
    directory = write_tiny("llama_tied", tmp_path / "llama_tied")
    outcome, codes = run_ranks(directory, 2, tmp_path / "rank0.pt", "3")
    assert codes == [0, 3]
    assert outcome["error"].startswith("RankLost: tensor-parallel "), outcome["error"]


class ShardOnly:
    """A group as build_engine's checks see it, before any collective."""

    def __init__(self, rank: int, size: int):
        self.shard = Shard(rank, size)


# KV heads that neither the ranks divide nor divide them; a Mamba2 mixer's groups fewer than the ranks under its gated
# norm (a group's statistics would span ranks: Granite 4.0-H as released).
@pytest.mark.parametrize("name, widths, size, message", [
    ("llama3_untied", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2, "num_key_value_heads (3)"),
    ("falcon_h1", {}, 4, "mamba n_groups (2) is not a multiple of --tensor-parallel 4 (fewer groups than ranks split "
                         "only without the mixer's gated norm)"),
    ("granite_hybrid", {}, 2, "mamba n_groups (1) is not a multiple of --tensor-parallel 2 (fewer groups")])
def test_what_cannot_be_split_is_refused_at_load(name, widths, size, message, tmp_path):
    directory = write_tiny(name, tmp_path / name, **widths)
    with pytest.raises(InvalidArgument, match="tensor.parallel") as caught:
        build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=8), group=ShardOnly(0, size))
    assert message in str(caught.value)


def test_a_checkpoint_s_fp8_weights_are_refused(tmp_path):
    """A published FP8 checkpoint's weights and their block scales would split apart: refused at load (--quantize
    fp8 quantizes each rank's part of a bf16 checkpoint instead)."""
    directory = write_fp8("llama_tied", tmp_path, block=(128, 128))
    with pytest.raises(InvalidArgument, match="tensor parallel splits plain tensors, not model.layers.0.self_attn."):
        build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=8), group=ShardOnly(0, 2))


def test_a_rank_holds_its_rows_or_columns_and_the_bias_once():
    weight, bias = torch.arange(24.0).view(4, 6), torch.arange(4.0)
    tensors = {"a.q_proj.weight": weight, "a.o_proj.weight": weight, "a.o_proj.bias": bias, "a.norm.weight": bias,
               "a.k_scale": bias.view(4, 1, 1), "b.k_scale": torch.tensor(0.5)}
    splits = {"q_proj.weight": COLUMNS, "o_proj.weight": ROWS, "o_proj.bias": ROWS, "k_scale": HEADS}
    first, second = (ShardedTensors(tensors, splits, Shard(rank, 2)) for rank in (0, 1))
    assert torch.equal(torch.cat([first["a.q_proj.weight"], second["a.q_proj.weight"]]), weight)
    assert torch.equal(torch.cat([first["a.o_proj.weight"], second["a.o_proj.weight"]], dim=1), weight)
    assert torch.equal(first["a.o_proj.bias"], bias) and not second["a.o_proj.bias"].any()
    assert first["a.norm.weight"] is bias
    # A value a KV head goes by heads, however shaped; one for all stays whole. Fewer heads than ranks: each rank
    # holds the head its query heads read (sharding.kv_heads), ranks 0-1 head 0, ranks 2-3 head 1.
    assert torch.equal(torch.cat([first["a.k_scale"], second["a.k_scale"]]), bias)
    two = {"a.k_scale": torch.tensor([0.5, 0.25])}
    assert [ShardedTensors(two, splits, Shard(rank, 4))["a.k_scale"].tolist() for rank in range(4)] == \
        [[0.5], [0.5], [0.25], [0.25]]
    assert ShardedTensors(two, splits, Shard(3, 4)).shape("a.k_scale") == (1,)
    assert first["b.k_scale"] is second["b.k_scale"] is tensors["b.k_scale"]
    assert [first.numel(n) for n in tensors] == [12, 12, 4, 4, 2, 1]
    with pytest.raises(InvalidArgument, match=r"a.q_proj.weight's rows \(4\) is not a multiple of --tensor-parallel 3"):
        ShardedTensors(tensors, splits, Shard(0, 3))["a.q_proj.weight"]


def test_stacked_experts_split_as_each_expert_would():
    """transformers 5's stacked experts: gate_up [E, 2 W, H] each half (the gate's rows, the up's) by rows,
    down [E, H, W] by columns, up alone [E, W, H] by rows: each rank's expert e is expert e's own split."""
    gate, up, down = torch.randn(3, 4, 6), torch.randn(3, 4, 6), torch.randn(3, 6, 4)
    tensors = {"m.experts.gate_up_proj": torch.cat([gate, up], dim=1), "m.experts.down_proj": down,
               "m.experts.up_proj": up}
    splits = {"experts.gate_up_proj": Segments((4, 4), dim=1), "experts.up_proj": COLUMNS,
              "experts.down_proj": ROWS}
    for rank in (0, 1):
        shard = ShardedTensors(tensors, splits, Shard(rank, 2))
        rows = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(shard["m.experts.gate_up_proj"], torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(shard["m.experts.down_proj"], down[..., rows])
        assert torch.equal(shard["m.experts.up_proj"], up[:, rows])
        assert [shard.shape(name) for name in tensors] == [(3, 4, 6), (3, 6, 2), (3, 2, 6)]
