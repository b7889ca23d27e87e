"""The sampler against transformers' logits processors, torch's log_softmax/topk/argmax and the Philox rule."""

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from metrale.runtime.sampling import OutputOptions, SampleRow, SamplingParams, sample, uniform
from metrale.runtime.sampling import sampler as sampler_module

WARPED = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.05),
          SamplingParams(temperature=1.1, top_k=200, top_p=0.95, min_p=0.02),
          SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=0.5, top_p=1e-6)]


def label(params: SamplingParams) -> str:
    return f"t{params.temperature:g}-k{params.top_k}-p{params.top_p:g}-m{params.min_p:g}"


def make_row(params=SamplingParams(), options=OutputOptions(), seed=1234, position=0, history=(), output_tokens=()):
    return SampleRow(params=params, options=options, seed=seed, position=position, history=list(history),
                     output_tokens=list(output_tokens))


def random_logits(rows, vocab_size, scale=3.0, seed=0):
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def hf_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] penalised logits -> [V] probabilities after transformers' warpers, in HF generate's order."""
    warpers = [hf.TemperatureLogitsWarper(params.temperature),
               hf.TopKLogitsWarper(params.top_k) if params.top_k else None,
               hf.TopPLogitsWarper(params.top_p) if params.top_p < 1.0 else None,
               hf.MinPLogitsWarper(params.min_p) if params.min_p else None]
    scores = x[None].clone()
    for warper in filter(None, warpers):
        scores = warper(torch.zeros((1, 1), dtype=torch.long), scores)
    return torch.softmax(scores[0], dim=-1)


def canonical_order(x: torch.Tensor) -> np.ndarray:
    return np.lexsort((np.arange(len(x)), -x.numpy()))  # x descending, lower id first


def inverse_cdf(order: np.ndarray, p: np.ndarray, u: float) -> int:
    """The first token of order whose float64 running sum of p exceeds u * the total."""
    cumulative = np.cumsum(p[order], dtype=np.float64)
    return int(order[min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), len(order) - 1)])


def reference_token(x: torch.Tensor, probs: torch.Tensor, u: float) -> int:
    """The documented draw over transformers' kept distribution."""
    order, probs = canonical_order(x), probs.numpy()
    return inverse_cdf(order[probs[order] > 0], probs, u)


def spec_token(x: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The sampler module docstring's rule, step by step over the fully sorted row (for ties, where HF's
    unstable sort leaves the top_p cut undefined)."""
    order = canonical_order(x)
    s = (x - x.max()) / params.temperature
    if params.top_k:
        s[x < x[order[params.top_k - 1]]] = -torch.inf
    p = torch.softmax(s, dim=-1).numpy()
    order = order[(p[order] > 0) & (p[order] >= params.min_p * p.max())]
    running = np.cumsum(p[order], dtype=np.float64)
    return inverse_cdf(order[running - p[order] < params.top_p] if params.top_p < 1 else order, p, u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_of_the_float32_logits(dtype):
    logits = random_logits(64, 5000).to(dtype)
    result = sample(logits, [make_row() for _ in range(64)])
    assert result.tokens == torch.argmax(logits.float(), dim=-1).tolist()


def test_greedy_ties_go_to_the_lowest_id_and_penalties_come_first():
    logits = torch.zeros(3, 100)
    logits[0, [70, 7, 30]] = 5.0
    logits[1, [99, 98]] = 1.0
    logits[2, [10, 20]] = torch.tensor([3.0, 2.0])
    rows = [make_row(), make_row(), make_row(SamplingParams(logit_bias=((10, -1.5),)))]
    assert sample(logits, rows).tokens == [7, 98, 20]


def test_repetition_penalty_matches_transformers():
    logits = random_logits(1, 3000)
    history = torch.randint(0, 3000, (400,), generator=torch.Generator().manual_seed(1))
    for penalty in (0.7, 1.3):
        processed = logits[0].clone()
        sampler_module.apply_penalties(processed, make_row(SamplingParams(repetition_penalty=penalty),
                                                           history=history.tolist()))
        expected = hf.RepetitionPenaltyLogitsProcessor(penalty)(history[None], logits.clone())[0]
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
    expected = hf.RepetitionPenaltyLogitsProcessor(1.2)(history[None], logits[None].clone())[0].double().numpy()
    counts = np.bincount(output, minlength=vocab_size)
    expected -= 0.4 * counts + -0.7 * (counts > 0)  # OpenAI / vLLM semantics
    np.add.at(expected, [3, 3, 499], [5.0, -1.5, -20.0])
    np.testing.assert_allclose(processed.numpy(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("params", WARPED, ids=label)
def test_sampled_tokens_follow_transformers_warpers_and_the_philox_rule(params):
    x = random_logits(1, 2000, scale=2.0, seed=3)[0]
    result = sample(x.expand(600, -1), [make_row(params, seed=99, position=p) for p in range(600)])
    probs = hf_probs(x, params)
    assert all(probs[token] > 0 for token in result.tokens)  # never a token transformers drops
    assert result.tokens == [reference_token(x, probs, uniform(99, p)) for p in range(600)]


def tied_logits(kind: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(15)
    if kind == "many":  # ~250 tokens per value: ties straddle the first head's cut
        return torch.randint(0, 12, (3000,), generator=generator).float() * 0.5
    x = torch.randn(3000, generator=generator) * 2  # a few ties inside the first head
    top = torch.topk(x, 40).indices
    for first, last in ((0, 5), (10, 14), (30, 33)):
        x[top[first:last]] = float(x[top[first]])
    return x


@pytest.mark.parametrize("kind", ["many", "inside"])
@pytest.mark.parametrize("params", WARPED, ids=label)
def test_tied_rows_follow_the_rule(params, kind):
    x = tied_logits(kind)
    result = sample(x.expand(300, -1), [make_row(params, seed=3, position=p) for p in range(300)])
    assert result.tokens == [spec_token(x, params, uniform(3, p)) for p in range(300)]


@pytest.mark.parametrize("params", WARPED, ids=label)
def test_distribution_equals_transformers_over_a_grid_of_u(params, monkeypatch):
    # u on a grid of midpoints: token j must take p_j of the grid, give or take one point per boundary
    grid = (np.arange(8192) + 0.5) / 8192
    monkeypatch.setattr(sampler_module, "uniform", lambda seed, position: float(grid[position]))
    x = random_logits(1, 2000, scale=2.0, seed=4)[0]
    tokens = sample(x.expand(len(grid), -1), [make_row(params, position=p) for p in range(len(grid))]).tokens
    probs = hf_probs(x, params).double().numpy()
    share, kept = np.bincount(tokens, minlength=len(probs)) / len(grid), np.flatnonzero(probs > 0)
    assert np.all(np.abs(share - probs) <= 2.0 / len(grid)) and set(tokens) <= set(kept.tolist())
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
    result = sample(x.expand(150, -1), [make_row(params, seed=7, position=p) for p in range(150)])
    expected = [spec_token(x, params, uniform(7, p)) if tied else reference_token(x, probs, uniform(7, p))
                for p in range(150)]
    assert result.tokens == expected


def test_empirical_frequencies_match_the_filtered_distribution():
    draws = 20000
    x = random_logits(1, 12, scale=1.5, seed=6)[0]
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=2024)
    tokens = sample(x.expand(draws, -1), [make_row(params, seed=2024, position=p) for p in range(draws)]).tokens
    probs = hf_probs(x, params).double().numpy()
    counts, kept = np.bincount(tokens, minlength=len(probs)), probs > 0
    assert counts[~kept].sum() == 0
    chi_square, degrees = float(np.sum((counts - draws * probs)[kept] ** 2 / (draws * probs[kept]))), kept.sum() - 1
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
    # reversed, each after a stranger
    strangers = random_logits(len(params), vocab_size, seed=9)
    order = list(reversed(range(len(params))))
    mixed_logits = torch.stack([row for i in order for row in (strangers[i], logits[i])])
    mixed_rows = [row for i in order for row in (make_row(WARPED[i % len(WARPED)], seed=i, position=3), rows[i])]
    assert sample(mixed_logits, mixed_rows).tokens[1::2] == alone[::-1]


def test_positions_and_seeds_change_the_draw():
    x, params = random_logits(1, 1000, scale=0.1, seed=10)[0].expand(100, -1), SamplingParams(temperature=1.0)
    by_position = sample(x, [make_row(params, seed=5, position=p) for p in range(100)]).tokens
    by_seed = sample(x, [make_row(params, seed=s, position=0) for s in range(100)]).tokens
    assert len(set(by_position)) > 80 and len(set(by_seed)) > 80
    assert sample(x, [make_row(params, seed=5, position=p) for p in range(100)]).tokens == by_position


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


def test_top_logprobs_are_topk_of_log_softmax_with_ties_to_the_lower_id():
    logits = random_logits(5, 5000, seed=12)
    logits[4, :] = 0.0
    logits[4, [40, 30, 20, 10, 45, 8, 4]] = torch.tensor([2.0, 2.0, 2.0, 2.0, 3.0, 2.5, 2.5])
    rows = [make_row(options=OutputOptions(top_logprobs=n)) for n in (1, 5, 20, 0, 5)]
    result = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    for i, n in enumerate((1, 5, 20)):
        values, ids = torch.topk(expected[i], n)
        assert result.top_logprobs[i][0] == ids.tolist()
        np.testing.assert_allclose(result.top_logprobs[i][1], values.numpy(), rtol=0, atol=1e-6)
    assert result.top_logprobs[3] is None
    ids, values = result.top_logprobs[4]
    assert ids == [45, 4, 8, 10, 20] and values[1] == values[2] and values[3] == values[4]


def test_return_logits_gives_the_raw_float32_row():
    logits = random_logits(3, 700, seed=13).to(torch.float16)
    asked = OutputOptions(return_logits=True)
    rows = [make_row(SamplingParams(temperature=1.0, repetition_penalty=2.0), asked, history=range(100)),
            make_row(), make_row(options=asked)]
    result = sample(logits, rows)
    assert result.logits[1] is None
    for i in (0, 2):
        assert result.logits[i].dtype == torch.float32 and torch.equal(result.logits[i], logits[i].float())


def test_edge_values_stay_finite():
    x = random_logits(1, 1000, seed=14)[0]
    rows = [make_row(SamplingParams(temperature=1e-30)), make_row(SamplingParams(temperature=1.0, top_k=10**9)),
            make_row(SamplingParams(temperature=1.0)), make_row(SamplingParams(temperature=1.0, min_p=1.0))]
    tokens = sample(x.expand(4, -1), rows).tokens
    assert tokens[0] == int(x.argmax()) and tokens[3] == int(x.argmax())
    assert tokens[1] == tokens[2]  # top_k past the vocabulary is off
    assert sample(torch.empty(0, 1000), []).tokens == []
    with pytest.raises(ValueError, match="NaN"):  # nothing to sample from
        sample(torch.full((1, 10), float("nan")), [make_row(SamplingParams(temperature=1.0))])


@pytest.mark.parametrize("temperature", [100.0, 1e37], ids=["max", "far past the range"])
def test_a_flat_row_of_tiny_gaps_samples_at_a_high_temperature(temperature):
    """Logits 1e-42 apart at temperature 100: s is subnormal, and the bucket scale 4095 / min(s) is past float32's
    range (it had become inf, then NaN buckets, and the step an error that took the worker out of rotation)."""
    x = -torch.arange(50000, dtype=torch.float32) * 1e-42
    result = sample(x.expand(40, -1), [make_row(SamplingParams(temperature=temperature), seed=3, position=p)
                                       for p in range(40)])
    assert all(0 <= token < 50000 for token in result.tokens)
    assert len(set(result.tokens)) > 30          # a near-uniform draw
