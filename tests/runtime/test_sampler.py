"""The sampler against transformers' logits processors, torch's log_softmax/topk/argmax and the Philox rule."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from metrale.runtime.sampling import OutputOptions, SampleRow, SamplingParams, sample, uniform
from metrale.runtime.sampling import sampler as sampler_module

WARPED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.1, top_k=200, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=0.5, top_p=1e-6),
]


def label(params: SamplingParams) -> str:
    return (f"t{params.temperature:g}-k{params.top_k}-p{params.top_p:g}-m{params.min_p:g}")


def make_row(params=SamplingParams(), options=OutputOptions(), seed=1234, position=0, history=(), output_tokens=()):
    return SampleRow(params=params, options=options, seed=seed, position=position, history=list(history),
                     output_tokens=list(output_tokens))


def random_logits(rows, vocab_size, scale=3.0, seed=0):
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def hf_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] penalised logits -> [V] probabilities after transformers' warpers, in HF generate's order."""
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores = x[None].clone()
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(input_ids, scores)
    return torch.softmax(scores[0], dim=-1)


def reference_token(x: torch.Tensor, probs: torch.Tensor, u: float) -> int:
    """The documented rule on HF's kept distribution: canonical order (x desc, lower id first), first c_j > u*T."""
    x, probs = x.numpy(), probs.numpy()
    order = np.lexsort((np.arange(len(x)), -x))
    order = order[probs[order] > 0]
    cumulative = np.cumsum(probs[order], dtype=np.float64)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return int(order[min(index, len(order) - 1)])


def spec_token(x: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The sampler module docstring's rule, step by step over the fully sorted row (for ties, where HF's
    unstable sort leaves the top_p cut undefined)."""
    order = np.lexsort((np.arange(len(x)), -x.numpy()))
    s = (x - x.max()) / params.temperature
    if params.top_k:
        s[x < x[order[params.top_k - 1]]] = -torch.inf
    p = torch.softmax(s, dim=-1).numpy()
    order = order[(p[order] > 0) & (p[order] >= params.min_p * p.max())]
    running = np.cumsum(p[order], dtype=np.float64)
    order = order[running - p[order] < params.top_p] if params.top_p < 1 else order
    cumulative = np.cumsum(p[order], dtype=np.float64)
    return int(order[min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), len(order) - 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_of_the_float32_logits(dtype):
    logits = random_logits(64, 5000).to(dtype)
    result = sample(logits, [make_row() for _ in range(64)])
    assert result.tokens == torch.argmax(logits.float(), dim=-1).tolist()


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, 100)
    logits[0, [70, 7, 30]] = 5.0
    logits[1, [99, 98]] = 1.0
    assert sample(logits, [make_row(), make_row()]).tokens == [7, 98]


def test_repetition_penalty_matches_transformers():
    logits = random_logits(1, 3000)
    history = torch.randint(0, 3000, (400,), generator=torch.Generator().manual_seed(1))
    for penalty in (0.7, 1.3):
        processed = logits[0].clone()
        sampler_module.apply_penalties(processed, make_row(SamplingParams(repetition_penalty=penalty),
                                                           history=history.tolist()))
        expected = RepetitionPenaltyLogitsProcessor(penalty)(history[None], logits.clone())[0]
        assert torch.equal(processed, expected)


def test_frequency_presence_and_bias_follow_repetition_penalty():
    vocab_size = 500
    logits = random_logits(1, vocab_size)[0]
    generator = np.random.default_rng(2)
    prompt, output = generator.integers(0, vocab_size, 100), generator.integers(0, vocab_size, 300)
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=-0.7,
                            logit_bias=((3, 5.0), (3, -1.5), (499, -20.0)))
    processed = logits.clone()
    sampler_module.apply_penalties(processed, make_row(params, history=[*prompt, *output], output_tokens=output))
    history = torch.as_tensor(np.concatenate([prompt, output]))
    expected = RepetitionPenaltyLogitsProcessor(1.2)(history[None], logits[None].clone())[0].double().numpy()
    counts = np.bincount(output, minlength=vocab_size)
    expected -= 0.4 * counts + -0.7 * (counts > 0)  # OpenAI / vLLM semantics
    expected[3] += 3.5
    expected[499] -= 20.0
    np.testing.assert_allclose(processed.numpy(), expected, rtol=0, atol=1e-5)


def test_greedy_picks_the_argmax_after_penalties():
    logits = random_logits(1, 1000)
    top = int(logits.argmax())
    params = SamplingParams(logit_bias=((top, -100.0),))
    assert sample(logits, [make_row(params)]).tokens == [int(torch.topk(logits[0], 2).indices[1])]


@pytest.mark.parametrize("params", WARPED, ids=label)
def test_sampled_tokens_follow_transformers_warpers_and_the_philox_rule(params):
    positions = 600
    x = random_logits(1, 2000, scale=2.0, seed=3)[0]
    result = sample(x.expand(positions, -1), [make_row(params, seed=99, position=p) for p in range(positions)])
    probs = hf_probs(x, params)
    assert all(probs[token] > 0 for token in result.tokens)  # never a token transformers drops
    assert result.tokens == [reference_token(x, probs, uniform(99, p)) for p in range(positions)]


@pytest.mark.parametrize("params", WARPED, ids=label)
def test_tied_rows_follow_the_rule(params):
    x = torch.randint(0, 12, (3000,), generator=torch.Generator().manual_seed(15)).float() * 0.5  # ~250 per value
    positions = 300
    result = sample(x.expand(positions, -1), [make_row(params, seed=3, position=p) for p in range(positions)])
    assert result.tokens == [spec_token(x, params, uniform(3, p)) for p in range(positions)]


@pytest.mark.parametrize("params", WARPED, ids=label)
def test_distribution_equals_transformers_over_a_grid_of_u(params, monkeypatch):
    # u on a grid of midpoints: token j must take p_j of the grid, give or take one point per boundary
    grid = (np.arange(8192) + 0.5) / 8192
    monkeypatch.setattr(sampler_module, "uniform", lambda seed, position: float(grid[position]))
    x = random_logits(1, 2000, scale=2.0, seed=4)[0]
    tokens = sample(x.expand(len(grid), -1), [make_row(params, position=p) for p in range(len(grid))]).tokens
    probs = hf_probs(x, params).double().numpy()
    share = np.bincount(tokens, minlength=len(probs)) / len(grid)
    assert np.all(np.abs(share - probs) <= 2.0 / len(grid))
    assert set(tokens) <= set(np.flatnonzero(probs > 0).tolist())
    kept = np.flatnonzero(probs > 0)
    # u just below 1 takes the last kept token of the canonical order, u just above 0 the first
    monkeypatch.setattr(sampler_module, "uniform", lambda seed, position: [1 - 2**-25, 2**-25][position])
    ends = sample(x.expand(2, -1), [make_row(params, position=p) for p in range(2)]).tokens
    assert ends == [int(kept[np.argmin(x.numpy()[kept])]), int(x.argmax())]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.5, top_p=0.9),
                                    SamplingParams(temperature=1.0, min_p=0.3)], ids=label)
@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_flat_rows_past_the_first_head_follow_the_rule(params, tied):
    x = random_logits(1, 50000, scale=0.5, seed=5)[0]
    if tied:
        x = torch.randint(0, 40, x.shape, generator=torch.Generator().manual_seed(5)).float() / 40  # many exact ties
    probs = hf_probs(x, params)
    assert float(torch.topk(probs, sampler_module.FIRST_HEAD).values.sum()) < 0.5  # the walk must leave the head
    positions = 150
    result = sample(x.expand(positions, -1), [make_row(params, seed=7, position=p) for p in range(positions)])
    if tied:
        assert result.tokens == [spec_token(x, params, uniform(7, p)) for p in range(positions)]
    else:
        assert result.tokens == [reference_token(x, probs, uniform(7, p)) for p in range(positions)]


def test_empirical_frequencies_match_the_filtered_distribution():
    draws = 20000
    x = random_logits(1, 12, scale=1.5, seed=6)[0]
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=2024)
    tokens = sample(x.expand(draws, -1), [make_row(params, seed=2024, position=p) for p in range(draws)]).tokens
    probs = hf_probs(x, params).double().numpy()
    counts = np.bincount(tokens, minlength=len(probs))
    kept = probs > 0
    assert counts[~kept].sum() == 0
    chi_square = float(np.sum((counts[kept] - draws * probs[kept]) ** 2 / (draws * probs[kept])))
    degrees = int(kept.sum()) - 1
    assert chi_square < degrees + 6 * np.sqrt(2 * degrees)


def test_a_seeded_row_is_independent_of_the_batch_around_it():
    vocab_size = 3000
    params = [SamplingParams(), *WARPED, SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5,
                                                        frequency_penalty=0.3, logit_bias=((5, 2.0),))]
    logits = random_logits(len(params), vocab_size, seed=8)
    rows = [make_row(p, seed=1000 + i, position=17 + i, history=range(0, 3000, 7), output_tokens=range(0, 900, 9))
            for i, p in enumerate(params)]
    alone = [sample(logits[i:i + 1], [row]).tokens[0] for i, row in enumerate(rows)]
    assert sample(logits, rows).tokens == alone
    # reversed, with strangers in between
    strangers = random_logits(len(params), vocab_size, seed=9)
    mixed_logits, mixed_rows, where = [], [], []
    for i in reversed(range(len(params))):
        where.append(len(mixed_rows))
        mixed_logits += [logits[i], strangers[i]]
        mixed_rows += [rows[i], make_row(WARPED[i % len(WARPED)], seed=i, position=3)]
    mixed = sample(torch.stack(mixed_logits), mixed_rows).tokens
    assert [mixed[w] for w in where] == alone[::-1]


def test_positions_and_seeds_change_the_draw():
    x = random_logits(1, 1000, scale=0.1, seed=10)[0]
    params = SamplingParams(temperature=1.0)
    by_position = sample(x.expand(100, -1), [make_row(params, seed=5, position=p) for p in range(100)]).tokens
    by_seed = sample(x.expand(100, -1), [make_row(params, seed=s, position=0) for s in range(100)]).tokens
    again = sample(x.expand(100, -1), [make_row(params, seed=5, position=p) for p in range(100)]).tokens
    assert len(set(by_position)) > 80 and len(set(by_seed)) > 80
    assert again == by_position


def test_logprobs_are_the_models_own_log_softmax():
    logits = random_logits(6, 4000, seed=11).to(torch.bfloat16)
    params = [SamplingParams(), SamplingParams(temperature=0.3, top_k=3, repetition_penalty=1.5),
              SamplingParams(temperature=1.0, logit_bias=((0, 30.0),))]
    rows = [make_row(params[i % 3], OutputOptions(logprobs=i < 4), history=range(50), output_tokens=range(10))
            for i in range(6)]
    result = sample(logits, rows)
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, token in enumerate(result.tokens):
        if i < 4:
            assert result.logprobs[i] == pytest.approx(float(expected[i, token]), abs=1e-6)
        else:
            assert np.isnan(result.logprobs[i])
    assert result.tokens[2] == 0  # the bias moved the choice, not the reported logprob


def test_top_logprobs_are_topk_of_log_softmax():
    logits = random_logits(4, 5000, seed=12)
    rows = [make_row(options=OutputOptions(top_logprobs=n)) for n in (1, 5, 20, 0)]
    result = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    for i, n in enumerate((1, 5, 20)):
        values, ids = torch.topk(expected[i], n)
        assert result.top_logprobs[i][0] == ids.tolist()
        np.testing.assert_allclose(result.top_logprobs[i][1], values.numpy(), rtol=0, atol=1e-6)
    assert result.top_logprobs[3] is None


def test_top_logprobs_break_ties_by_lower_id():
    logits = torch.zeros(1, 50)
    logits[0, [40, 30, 20, 10]] = 2.0
    logits[0, 45] = 3.0
    ids, values = sample(logits, [make_row(options=OutputOptions(top_logprobs=3))]).top_logprobs[0]
    assert ids == [45, 10, 20]
    assert values[1] == values[2]


def test_return_logits_gives_the_raw_float32_row():
    logits = random_logits(3, 700, seed=13).to(torch.float16)
    rows = [make_row(SamplingParams(temperature=1.0, repetition_penalty=2.0), OutputOptions(return_logits=True),
                     history=range(100)), make_row(), make_row(options=OutputOptions(return_logits=True))]
    result = sample(logits, rows)
    assert result.logits[1] is None
    for i in (0, 2):
        assert result.logits[i].dtype == torch.float32 and result.logits[i].shape == (700,)
        assert torch.equal(result.logits[i], logits[i].float())


def test_edge_values_stay_finite():
    x = random_logits(1, 1000, seed=14)[0]
    rows = [make_row(SamplingParams(temperature=1e-30)), make_row(SamplingParams(temperature=1.0, top_k=10**9)),
            make_row(SamplingParams(temperature=1.0)), make_row(SamplingParams(temperature=1.0, min_p=1.0))]
    tokens = sample(x.expand(4, -1), rows).tokens
    assert tokens[0] == int(x.argmax()) and tokens[3] == int(x.argmax())
    assert tokens[1] == tokens[2]  # top_k past the vocabulary is off
    assert sample(torch.empty(0, 1000), []).tokens == []


def test_a_row_without_a_finite_maximum_is_refused():
    logits = torch.full((1, 10), float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        sample(logits, [make_row(SamplingParams(temperature=1.0))])
