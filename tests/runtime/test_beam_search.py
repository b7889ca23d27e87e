"""Beam search on the engine (decoder-only, CPU, float32) against transformers' generate on the same checkpoint:
the same hypotheses token for token and scores within 1e-4, for calls that batch requests of different prompt
lengths, beam counts, length penalties, early_stopping modes, no_repeat_ngram_size and num_return_sequences; and
every KV block back in the pool afterwards."""

import collections
import itertools

import pytest
import torch

from metrale.runtime.beam.candidates import best_first
from metrale.runtime.beam.params import BeamParams, BeamRequest
from metrale.runtime.beam.call import SHORT_PROMPT
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import Cancelled, InvalidArgument, OutOfKvBlocks, StepFailed
from metrale.runtime.loading import load_checkpoint
from beam_reference import (FILL, LogitsRecorder, assert_same, check_search, reference_hypotheses,
                            round_logits_to_bf16)
from tiny_models import load_reference, write_tiny

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 150, 33, 61, 2, 90, 14, 77, 101, 12], [250], [4, 66, 31, 9, 180, 44, 71] * 3]


# model -> the seed of its random weights: with the EOS ids below, each case ends some hypotheses early and runs
# some to max_new_tokens.
SEEDS = {"llama_tied": 2, "nemotron_h": 2, "hy_v4": 3}


@pytest.fixture(scope="module", params=sorted(SEEDS))
def models(request, tmp_path_factory):
    """A Llama, a hybrid whose beams also carry recurrent states, and Hy4, whose beams carry latents and sparse
    attention's index keys through hyper-connection streams."""
    directory = write_tiny(request.param, tmp_path_factory.mktemp("beam") / request.param, seed=SEEDS[request.param])
    engine, _ = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=400, kv_block_size=4))
    reference = load_reference(directory)
    # A second EOS id: the token greedy search emits most, so hypotheses finish early and often.
    greedy = reference.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=FILL)[0, len(PROMPTS[0]):].tolist()
    eos = (2, collections.Counter(greedy).most_common(1)[0][0])
    return engine, reference, eos


CASES = list(itertools.product((0.0, 1.0, 2.0), (True, False, "never")))


@pytest.mark.parametrize("length_penalty, early_stopping", CASES)
def test_batched_calls_match_transformers(models, length_penalty, early_stopping):
    engine, reference, eos = models
    free = engine.cache.blocks.num_free, engine.cache.states.num_free
    requests = []
    for i, (prompt, beams, ngram) in enumerate(zip(PROMPTS * 2, (1, 2, 4, 5, 5, 4, 2, 1), (0, 3) * 4)):
        params = BeamParams(num_beams=beams, max_new_tokens=6 + 3 * i, min_new_tokens=2 * (i % 3),
                            length_penalty=length_penalty, early_stopping=early_stopping, no_repeat_ngram_size=ngram,
                            num_return_sequences=max(1, beams - i % 2))
        requests.append(BeamRequest(100 + i, prompt_tokens=tuple(prompt), params=params))
    results = engine.beam_generate(requests, eos, FILL)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    for request, result in zip(requests, results):
        expected = reference_hypotheses(reference, list(request.prompt_tokens), request.params, eos)
        assert_same(result.hypotheses, expected)
    assert (engine.cache.blocks.num_free, engine.cache.states.num_free) == free
    # Some hypotheses finished early (an EOS) and some ran to max_new_tokens: both paths were exercised.
    lengths = [(len(t), r.params.max_new_tokens) for r, res in zip(requests, results) for t, _ in res.hypotheses]
    assert any(n < m for n, m in lengths) and any(n == m for n, m in lengths)


def test_a_call_alone_or_batched_gives_the_same_hypotheses(models):
    """The same tokens; scores equal up to float32 summation order (a batched GEMM adds in another order)."""
    engine, _, eos = models
    requests = [BeamRequest(i, prompt_tokens=tuple(p), params=BeamParams(num_beams=4, max_new_tokens=10,
                                                                         num_return_sequences=2))
                for i, p in enumerate(PROMPTS)]
    together = engine.beam_generate(requests, eos, FILL)
    alone = [engine.beam_generate([r], eos, FILL)[0] for r in requests]
    for batched, single in zip(together, alone):
        assert batched.request_id == single.request_id
        assert_same(batched.hypotheses, single.hypotheses)


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, True), (2.0, "never")])
def test_short_prompts_a_token_a_forward_match_transformers(models, monkeypatch, length_penalty, early_stopping):
    """Where decode forwards replay graphs, prompts of at most SHORT_PROMPT tokens run as decode steps, a token a
    forward, each prompt ending at its own length: the same hypotheses as transformers, and no forward over more
    than one token of a prompt."""
    engine, reference, eos = models
    monkeypatch.setattr(engine.runner, "decode_graph_rows", 256)
    query_lens, forward = [], engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda batch, kv: query_lens.append(max(batch.query_lens))
                        or forward(batch, kv))
    free = engine.cache.blocks.num_free
    prompts = [[5, 17, 99, 3], [250], [7, 8], [4, 66, 31]][:SHORT_PROMPT]
    requests = [BeamRequest(i, prompt_tokens=tuple(p), params=BeamParams(
        num_beams=beams, max_new_tokens=8, min_new_tokens=i, length_penalty=length_penalty,
        early_stopping=early_stopping, no_repeat_ngram_size=ngram, num_return_sequences=max(1, beams - 1)))
        for i, (p, beams, ngram) in enumerate(zip(prompts, (4, 2, 5, 1), (0, 3, 0, 3)))]
    results = engine.beam_generate(requests, eos, FILL)
    for request, result in zip(requests, results):
        assert_same(result.hypotheses, reference_hypotheses(reference, list(request.prompt_tokens), request.params,
                                                             eos))
    assert query_lens and max(query_lens) == 1
    assert engine.cache.blocks.num_free == free


def test_short_prompts_of_more_requests_than_a_decode_graph_holds_run_in_one_forward(models, monkeypatch):
    """Past the largest decode graph a token's forward would run eagerly, a launch per kernel each token: the
    prompts of such a call go in one forward instead, with the same hypotheses."""
    engine, reference, eos = models
    monkeypatch.setattr(engine.runner, "decode_graph_rows", 2)
    query_lens, forward = [], engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda batch, kv: query_lens.append(max(batch.query_lens))
                        or forward(batch, kv))
    requests = [BeamRequest(i, prompt_tokens=(5, 17, 99), params=BeamParams(num_beams=2, max_new_tokens=4))
                for i in range(3)]
    for request, result in zip(requests, engine.beam_generate(requests, eos, FILL)):
        assert_same(result.hypotheses, reference_hypotheses(reference, list(request.prompt_tokens), request.params,
                                                             eos))
    assert query_lens[0] == 3
    query_lens.clear()
    engine.beam_generate(requests[:2], eos, FILL)
    assert max(query_lens) == 1


@pytest.mark.parametrize("length_penalty, early_stopping", [(0.0, "never"), (2.0, True)])
@pytest.mark.parametrize("rounded", [False, True])
def test_the_search_is_transformers_search_over_our_logits(models, monkeypatch, length_penalty, early_stopping,
                                                           rounded):
    """Decoder-only prompts (distinct, as LogitsRecorder needs): transformers' generate over the logits our
    forwards computed gives every request our hypotheses; rounded: over bf16-rounded logits, ties and all."""
    engine, reference, eos = models
    if rounded:
        round_logits_to_bf16(engine, monkeypatch)
    requests = [BeamRequest(i, prompt_tokens=tuple(prompt), params=BeamParams(
        num_beams=beams, max_new_tokens=5 + 3 * i, min_new_tokens=i % 3, length_penalty=length_penalty,
        early_stopping=early_stopping, no_repeat_ngram_size=3 * (i % 2), num_return_sequences=max(1, beams - 1)))
        for i, (prompt, beams) in enumerate(zip(PROMPTS, (4, 2, 5, 1)))]
    with LogitsRecorder(engine) as recorder:
        results = engine.beam_generate(requests, eos, FILL)
    for i, (request, result) in enumerate(zip(requests, results)):
        check_search(result.hypotheses, reference, recorder, i, list(request.prompt_tokens), request.params, eos)


def test_too_few_free_blocks_refuses_the_call_and_changes_nothing(models):
    engine, _, eos = models
    free = engine.cache.blocks.num_free
    huge = BeamRequest(1, prompt_tokens=tuple(PROMPTS[3]), params=BeamParams(num_beams=32, max_new_tokens=400))
    with pytest.raises(OutOfKvBlocks):
        engine.beam_generate([huge], eos, FILL)
    assert engine.cache.blocks.num_free == free


def test_a_call_cancelled_mid_search_gives_every_block_back(models):
    engine, _, eos = models
    free = engine.cache.blocks.num_free
    checks = iter(range(100))
    requests = [BeamRequest(i, prompt_tokens=tuple(p), params=BeamParams(num_beams=4, max_new_tokens=30,
                                                                         min_new_tokens=30))
                for i, p in enumerate(PROMPTS)]
    with pytest.raises(Cancelled):
        engine.beam_generate(requests, eos, FILL, cancelled=lambda: next(checks) == 5)   # before the 6th step
    assert engine.cache.blocks.num_free == free


def test_more_continuations_than_the_vocabulary_is_refused(models):
    """keep = max(2, 1 + #EOS) x num_beams candidates per beam must exist: 32 beams and 8 EOS ids keep 288, over
    the tiny vocabulary's 256."""
    engine, _, _ = models
    free = engine.cache.blocks.num_free
    request = BeamRequest(1, prompt_tokens=tuple(PROMPTS[0]), params=BeamParams(num_beams=32, max_new_tokens=4))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        engine.beam_generate([request], tuple(range(2, 10)), FILL)
    assert engine.cache.blocks.num_free == free


def test_non_finite_logits_end_the_call_alone_and_every_block_back(models, monkeypatch):
    engine, _, eos = models
    free = engine.cache.blocks.num_free
    forward = engine.forwards.forward
    calls = iter(range(100))

    def poisoned(batch):
        logits = forward(batch)
        return logits.fill_(float("nan")) if next(calls) == 3 else logits     # the third decode step's logits

    monkeypatch.setattr(engine.forwards, "forward", poisoned)
    request = BeamRequest(1, prompt_tokens=tuple(PROMPTS[1]), params=BeamParams(num_beams=4, max_new_tokens=10,
                                                                                 min_new_tokens=10))
    with pytest.raises(StepFailed, match="finite"):       # on the host: the model's logits, not the device, failed
        engine.beam_generate([request], eos, FILL)
    assert engine.cache.blocks.num_free == free


def test_the_prompt_pass_hands_over_a_device_search(models, monkeypatch):
    """What a device search step starts from (runtime/beam/on_device.py), built on the CPU engine: each request's
    beams on its prompt's blocks (as many holders as beams), every reserved block free or held, the length
    penalty divisors as BeamGroup computes them, the prompt's candidates once per beam, not read on the host before
    the hand-over (the host does not wait for the prompt pass), and the state's arrays laid out (the CUDA backend's
    state_arrays) without a device."""
    from metrale.runtime.backend.cuda.beam_search import state_arrays

    engine, _, eos = models
    requests = [BeamRequest(i, prompt_tokens=tuple(p), params=BeamParams(num_beams=k, max_new_tokens=5 + i,
                                                                         length_penalty=lp))
                for i, (p, k, lp) in enumerate(zip(PROMPTS, (3, 1, 3, 2), (1.0, 0.5, 2.0, -1.0)))]
    seen, reads = [], []
    monkeypatch.setattr(engine.runner, "device_search", lambda search, *_: seen.append(search))
    candidates = engine.runner.beam_candidates

    class Recorded:
        def __init__(self, found):
            self.found = found

        def host(self):
            reads.append(len(seen))                        # how many hand-overs came before the read
            return self.found.host()

    monkeypatch.setattr(engine.runner, "beam_candidates", lambda *args: Recorded(candidates(*args)))
    free = engine.cache.blocks.num_free
    engine.beam_generate(requests, eos, FILL)             # stepped on the host: the CPU backend returns None
    if engine.cache.has_state:          # the device search carries no recurrent state: the host steps it always
        assert engine.cache.blocks.num_free == free and seen == []
        return
    assert engine.cache.blocks.num_free == free and len(seen) == 1
    assert reads and min(reads) == 1
    search = seen[0]
    order = [0, 2, 1, 3]                                  # grouped by num_beams, in call order
    assert search.num_beams.tolist() == [3, 3, 1, 2] and search.beam_base.tolist() == [0, 3, 6, 7]
    assert search.prompts == [PROMPTS[i] for i in order]
    assert search.max_length.tolist() == [len(PROMPTS[i]) + 5 + i for i in order]
    size = search.block_size
    for r, i in enumerate(order):
        beams = search.tables[search.beam_base[r]:search.beam_base[r] + search.num_beams[r]]
        assert all(t == beams[0] for t in beams) and len(beams[0]) == -(-len(PROMPTS[i]) // size)
        assert all(search.holders[b] == search.num_beams[r] for b in beams[0])
        lp = requests[i].params.length_penalty
        assert search.divisors[r, 1:6 + i].tolist() == [torch.tensor(float(n) ** lp).float().item()
                                                        for n in range(1, 6 + i)]
        rows = search.candidate_arrays()[1][search.beam_base[r]:search.beam_base[r] + search.num_beams[r]]
        assert (rows == rows[0]).all()
    held = set(int(b) for b in search.holders.nonzero()[0])
    assert held.isdisjoint(search.free.tolist()) and len(held) + len(search.free) == len(search.block_ids)
    arrays = state_arrays(search, max_blocks=64)
    assert arrays["running"].shape == (2, 9, search.max_len) and arrays["done"].shape == (5,)
    assert arrays["running"][1, 4, :len(PROMPTS[2])].tolist() == PROMPTS[2]


def test_best_first_breaks_ties_to_the_lower_index():
    """The host search's and the CPU candidates' top-k (best_first) ranks as a stable descending sort, as the CUDA
    kernels and the replayed transformers search do, NaN-free rows with many ties and -inf rows alike."""
    generator = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 40):
        values = torch.randint(-3, 3, (5, n), generator=generator).float()
        values[0] = -torch.inf
        for k in range(1, n + 1):
            expected = torch.sort(values, dim=-1, descending=True, stable=True)
            ours = best_first(values, k)
            assert torch.equal(ours[0], expected.values[:, :k]) and torch.equal(ours[1], expected.indices[:, :k])
