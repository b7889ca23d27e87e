"""A prompt split into chunks anywhere (gateway slices, the worker's own chunk_size, several sequences' slices in one
step, decode lanes beside them) gives the logits of one chunk, within 1e-5 (float32, CPU), for the families whose
chunks hand something on: a state-space model's conv and scan states, carried across chunks exactly, and multi-head
latent attention's cached latents, which a later chunk attends to. On CUDA (bf16) within bf16's rounding: a GEMM
over other row counts rounds differently."""

import json
import random

import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import TINY_MLA, TINY_SPARSE, TINY_SSM, write_tiny

BLOCK = 16
PROMPT_LEN = 45
DECODES = 6
LOGITS = OutputOptions(return_logits=True)


# The largest relative error of a chunked run's logits against one chunk's, by device. On CUDA a latent attention
# model's prompt rows are up-projected and its one-token rows attend in the latent space: the same attention with its
# bf16 roundings in other places (a prompt sent a token at a time: 2.7e-2 at most in DeepSeek-V3's tiny model).
TOLERANCE = {"cpu": 1e-5, "cuda": 3e-2}


@pytest.fixture(scope="module", params=[*sorted(TINY_SSM), *sorted(TINY_MLA), *sorted(TINY_SPARSE), *(
    pytest.param(f"{name} cuda", marks=pytest.mark.gpu)
    for name in sorted(TINY_SSM) + sorted(TINY_MLA) + sorted(TINY_SPARSE))])
def engine(request, tmp_path_factory):
    name, _, device = request.param.partition(" ")
    directory = write_tiny(name, tmp_path_factory.mktemp(name))
    if device == "cuda":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **without_choices(config)}))
    engine, _ = build_engine(load_checkpoint(directory),
                             EngineConfig(device=device or "cpu", kv_blocks=96, kv_block_size=BLOCK, max_seqs=16,
                                          max_batch_tokens=256), cache_dir=tmp_path_factory.mktemp("kernels"))
    return engine


def without_choices(config: dict) -> dict:
    """The config changes that leave a CUDA run nothing near a tie to choose. bf16 moves many a query's k-th and next
    index scores past each other, and a mixture router's k-th and next experts (a random model's near ties): a GEMM
    over other row counts rounds differently, so a chunked run and one chunk may choose differently there, and every
    logit of that row moves. So an indexer keeps every token and every routed expert is taken, here; which tokens and
    experts they choose is checked against transformers (CPU, and test_cuda_models on the GPU)."""
    changes = {"index_topk": 512} if "index_topk" in config else {}
    experts = next((config[key] for key in ("n_routed_experts", "num_local_experts", "num_experts")
                    if config.get(key)), 0)
    if experts and config.get("num_experts_per_tok"):
        changes["num_experts_per_tok"] = experts
        if config.get("n_group"):
            changes["topk_group"] = config["n_group"]
    return changes


def prompt(seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist())


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def decode_logits(engine, seq_id: int, first, feed: list[int] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """The prompt's last logits, then DECODES steps' logits, and the tokens the steps fed: each step's greedy token,
    or feed's (a chunked run takes the one-chunk run's tokens, so a near tie that bf16 breaks the other way does
    not send the two down different continuations); releases the sequence."""
    rows, out, fed = [first.logits], first, []
    for i in range(DECODES):
        fed.append(out.token if feed is None else feed[i])
        out = engine.step(Step(decode=(DecodeToken(seq_id, fed[-1]),))).outputs[0]
        rows.append(out.logits)
    engine.release([seq_id])
    return rows, fed


def one_chunk(engine, seq_id: int, tokens) -> tuple[list[torch.Tensor], list[int]]:
    out = engine.step(Step(prefill=(PrefillSlice(seq_id, tokens, output=LOGITS),))).outputs[0]
    return decode_logits(engine, seq_id, out)


def slices(tokens, cuts: list[int], seq_id: int) -> list[PrefillSlice]:
    bounds = [0, *cuts, len(tokens)]
    return [PrefillSlice(seq_id, tokens[a:b], chunk_start=a, is_last_chunk=b == len(tokens), output=LOGITS)
            for a, b in zip(bounds, bounds[1:])]


SPLITS = {"one token first": [1], "block - 1": [BLOCK - 1], "block": [BLOCK], "block + 1": [BLOCK + 1],
          "every token": list(range(1, PROMPT_LEN)), "random": sorted(random.Random(5).sample(range(1, PROMPT_LEN), 6)),
          "last token alone": [PROMPT_LEN - 1]}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_gateway_chunks_equal_one_chunk(engine, split):
    tokens = prompt(1)
    want, fed = one_chunk(engine, 1, tokens)
    for piece in slices(tokens, SPLITS[split], 2):
        out = engine.step(Step(prefill=(piece,)))
    got, _ = decode_logits(engine, 2, out.outputs[0], fed)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) < TOLERANCE[engine.runner.device], f"{split}: row {i}"


@pytest.mark.parametrize("chunk_size", [1, BLOCK - 1, BLOCK, 7])
def test_worker_chunk_size_equals_one_chunk(engine, chunk_size):
    tokens = prompt(2)
    want, fed = one_chunk(engine, 1, tokens)
    out = engine.step(Step(prefill=(PrefillSlice(2, tokens, chunk_size=chunk_size, output=LOGITS),)))
    got, _ = decode_logits(engine, 2, out.outputs[0], fed)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) < TOLERANCE[engine.runner.device], f"chunk_size {chunk_size}: row {i}"


def beside_a_lane(engine, pending: dict[int, list[PrefillSlice]]) -> dict:
    """Each sequence's slices sent together step by step (one of each a step) beside a sequence decoding (then
    released): each sequence's output of its last slice."""
    lane = engine.step(Step(prefill=(PrefillSlice(20, prompt(6)[:9]),))).outputs[0]
    firsts = {}
    while any(pending.values()):
        batch = tuple(queue.pop(0) for queue in pending.values() if queue)
        out = engine.step(Step(decode=(DecodeToken(20, lane.token),), prefill=batch))
        lane = next(o for o in out.outputs if o.seq_id == 20)
        firsts.update({o.seq_id: o for o in out.outputs if o.seq_id != 20})
    engine.release([20])
    return firsts


def test_slices_batched_with_decode_lanes(engine):
    """Three prompts cut differently, their slices sent together step by step, beside a sequence decoding."""
    prompts = {10: prompt(3), 11: prompt(4), 12: prompt(5)}
    want = {seq_id: one_chunk(engine, seq_id + 100, tokens) for seq_id, tokens in prompts.items()}
    firsts = beside_a_lane(engine, {10: slices(prompts[10], [BLOCK, 2 * BLOCK], 10),
                                    11: slices(prompts[11], [3, 17, 40], 11),
                                    12: slices(prompts[12], [1, 2, BLOCK + 1], 12)})
    for seq_id in prompts:
        got, _ = decode_logits(engine, seq_id, firsts[seq_id], want[seq_id][1])
        for i, (a, b) in enumerate(zip(got, want[seq_id][0])):
            assert relative_error(a, b) < TOLERANCE[engine.runner.device], f"seq {seq_id}: row {i}"


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.gpu) for name in sorted(TINY_MLA)])
def latent_cuda_engine(request, tmp_path_factory):
    directory = write_tiny(request.param, tmp_path_factory.mktemp(request.param))
    engine, _ = build_engine(load_checkpoint(directory),
                             EngineConfig(device="cuda", kv_blocks=96, kv_block_size=BLOCK, max_seqs=16,
                                          max_batch_tokens=256), cache_dir=tmp_path_factory.mktemp("kernels"))
    return engine


def test_contexts_in_pieces_equal_one_chunk(latent_cuda_engine, monkeypatch):
    """CUDA's up-projected latent prefill over contexts cut into pieces of 64 keys (a segment across pieces, several
    segments in one) merged by log-sum-exp: three prompts sliced and batched beside a decode lane, as one chunk."""
    from metrale.runtime.backend.cuda import latent_prefill

    monkeypatch.setattr(latent_prefill, "PIECE_BYTES", 1)       # the smallest piece: one tile of keys
    engine = latent_cuda_engine
    prompts = {10: prompt(3), 11: prompt(4), 12: prompt(5)}
    want = {seq_id: one_chunk(engine, seq_id + 100, tokens) for seq_id, tokens in prompts.items()}
    firsts = beside_a_lane(engine, {10: slices(prompts[10], [BLOCK, 2 * BLOCK], 10),
                                    11: slices(prompts[11], [3, 40], 11), 12: slices(prompts[12], [BLOCK + 1], 12)})
    for seq_id in prompts:
        got, _ = decode_logits(engine, seq_id, firsts[seq_id], want[seq_id][1])
        for i, (a, b) in enumerate(zip(got, want[seq_id][0])):
            assert relative_error(a, b) < TOLERANCE["cuda"], f"seq {seq_id}: row {i}"
