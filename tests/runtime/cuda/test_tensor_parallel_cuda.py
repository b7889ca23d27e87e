"""Tensor parallel on the CUDA backend: the ranks' sums and gathers over NCCL (inside the decode graphs), against the
one-device engine on the same checkpoint. One rank runs on any GPU (every collective and the gathered logits' layout,
with nothing to split); two ranks need two GPUs, rank 1 in a process of its own as `serve --tensor-parallel 2` starts
it."""

import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.parallel.group import GlooGroup, Shard
from metrale.runtime.parallel.launch import free_address, start_followers
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import write_tiny

from gpu_reference import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu
NUM_DECODES = 64
CONFIG = EngineConfig(device="cuda", kv_blocks=64, max_batch_tokens=256, max_seqs=8, cuda_graph_batch_sizes=(1, 2, 4))
PROMPTS = {1: list(range(3, 23)), 2: list(range(40, 53))}


def forced_greedy(engine, tokens: dict[int, list[int]] | None = None) -> tuple[dict, dict]:
    """Both prompts in one prefill, then NUM_DECODES decode steps of both (graph replays): each step fed `tokens`'
    next (the one device's choices, so that a near-tie cannot send the two runs down different contexts), or the
    engine's own choice where tokens is None. Every sequence's chosen tokens and logits rows."""
    logits_out = OutputOptions(return_logits=True)
    out = engine.step(Step(prefill=tuple(PrefillSlice(seq, tuple(prompt), output=logits_out)
                                         for seq, prompt in PROMPTS.items()))).outputs
    chosen = {seq: [o.token] for seq, o in zip(PROMPTS, out)}
    rows = {seq: [o.logits] for seq, o in zip(PROMPTS, out)}
    for step in range(NUM_DECODES):
        fed = {seq: (tokens or chosen)[seq][step] for seq in PROMPTS}
        out = engine.step(Step(decode=tuple(DecodeToken(seq, token) for seq, token in fed.items()))).outputs
        for seq, o in zip(PROMPTS, out):
            chosen[seq].append(o.token)
            rows[seq].append(o.logits)
    return chosen, rows


def assert_agrees(chosen, rows, expected_tokens, expected_rows):
    """Logits within bf16's bound of the one device's; greedy tokens equal wherever the one device's top two stand
    clear of bf16 noise."""
    for seq in PROMPTS:
        for i, (ours, want) in enumerate(zip(rows[seq], expected_rows[seq])):
            assert relative_error(ours, want) < TOLERANCE[torch.bfloat16], f"sequence {seq}, output {i}"
            top2 = want.topk(2).values
            if top2[0] - top2[1] > 0.05 * top2[0].abs().clamp(min=1):
                assert chosen[seq][i] == expected_tokens[seq][i], f"sequence {seq}, output {i}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama at a trained model's weight scale, and the one-device engine's greedy run over it."""
    directory = write_tiny("llama3_untied", tmp_path_factory.mktemp("llama"), weight_std=0.04, norm_std=0.1)
    engine, _ = build_engine(load_checkpoint(directory), CONFIG, cache_dir=tmp_path_factory.mktemp("cache"))
    tokens, rows = forced_greedy(engine)
    return directory, tokens, rows


@pytest.mark.parametrize("name", ["llama3_untied", "llama_tied"])
def test_one_rank_over_nccl_gives_the_one_device_run(name, tmp_path):
    """A group of one: every sum goes through NCCL, the LM head's part is all of it, the logits come through the
    gather and rank 0's copies into place; prefill eagerly and every decode step from a captured graph."""
    directory = write_tiny(name, tmp_path / name, weight_std=0.04, norm_std=0.1)
    one_device, _ = build_engine(load_checkpoint(directory), CONFIG, cache_dir=tmp_path / "cache")
    tokens, rows = forced_greedy(one_device)
    group = GlooGroup(Shard(0, 1), free_address())
    engine, _ = build_engine(load_checkpoint(directory), CONFIG, cache_dir=tmp_path / "cache", group=group)
    try:
        chosen, ours = forced_greedy(engine, tokens)
        assert engine.runner.counters()["graph_replays"] >= NUM_DECODES
    finally:
        engine.runner.stop()
    assert_agrees(chosen, ours, tokens, rows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs")
def test_two_ranks_give_the_one_device_run(llama, tmp_path):
    """Rank 1 on the second GPU, in a process of its own; heads, KV heads, MLP widths and the vocabulary split in
    two."""
    directory, tokens, rows = llama
    address = free_address()
    followers = start_followers(str(directory), CONFIG, 2, address, str(tmp_path / "cache"))
    group = GlooGroup(Shard(0, 2), address)
    try:
        engine, _ = build_engine(load_checkpoint(directory), CONFIG, cache_dir=tmp_path / "cache", group=group)
        chosen, ours = forced_greedy(engine, tokens)
        engine.runner.stop()
    finally:
        for follower in followers:
            follower.join(timeout=30)
            if follower.is_alive():
                follower.terminate()
    assert [follower.exitcode for follower in followers] == [0]
    assert_agrees(chosen, ours, tokens, rows)


def test_one_rank_renews_its_communicator_after_a_step_fails_partway(tmp_path):
    """Rank 0's prefill raises after its third sum (a bug there): the step fails alone (StepFailed); the ranks renew
    the communicator, which closes the decode graphs captured at warm-up over the old one first (NCCL's abort waits
    for them) and captures them again at their next use; every step after gives the one-device run."""
    from metrale.runtime.errors import StepFailed

    directory = write_tiny("llama3_untied", tmp_path / "llama", weight_std=0.04, norm_std=0.1)
    one_device, _ = build_engine(load_checkpoint(directory), CONFIG, cache_dir=tmp_path / "cache")
    tokens, rows = forced_greedy(one_device)
    group = GlooGroup(Shard(0, 1), free_address())
    engine, _ = build_engine(load_checkpoint(directory), CONFIG, cache_dir=tmp_path / "cache", group=group)
    math, calls = engine.model.math, []
    all_reduce = math.all_reduce

    def failing(x):
        calls.append(x)
        out = all_reduce(x)
        if len(calls) == 3:
            raise RuntimeError("injected after a collective")
        return out
    math.all_reduce = failing
    try:
        with pytest.raises(StepFailed):
            engine.step(Step(prefill=tuple(PrefillSlice(seq, tuple(prompt)) for seq, prompt in PROMPTS.items())))
        math.all_reduce = all_reduce
        assert group.generation == 1
        chosen, ours = forced_greedy(engine, tokens)
        assert engine.runner.counters()["graph_replays"] >= NUM_DECODES
    finally:
        engine.runner.stop()
    assert_agrees(chosen, ours, tokens, rows)
