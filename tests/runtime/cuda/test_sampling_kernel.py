"""sampling.cu against the CPU sampler (metrale/runtime/sampling/sampler.py).

The host-only checks (packers, launcher arguments) are in test_sampling_launchers.py.

Tokens: the same as sample() on every row whose decisions are not within float rounding of a boundary; the
margin is measured on the CPU side, in float64 over the same float32 s (MARGIN relative; top_p's widened by the
CPU softmax's own normalisation error). Logprobs and top-n: float64 log_softmax of the raw row. Penalties: bit
for bit against sampler.apply_penalties. Every output is poisoned before the launch."""

import numpy as np
import pytest
import torch

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.kernels import sampling as sampling_launchers  # noqa: E402
from metrale.runtime.backend.cuda.kernels.sampling import (  # noqa: E402
    apply_penalties, pack_penalties, pack_sampling_params, sample_rows)
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.sampling import OutputOptions, SampleRow, SamplingParams, sample, uniform  # noqa: E402
from metrale.runtime.sampling import sampler as cpu_sampler  # noqa: E402

gpu = pytest.mark.gpu
DEVICE = "cuda"
WIDTH = 20            # columns of the top-n outputs
MARGIN = 1e-6         # relative distance from a boundary below which float rounding may decide
NEAR_TIE = 2e-6       # float32 logprobs closer than this may merge, and then order by id
POISON = 12345.0      # exact in float32
WARPED = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
          for t in (0.7, 1.0, 1.3) for k in (0, 1, 50) for p in (1.0, 0.9, 0.5) for m in (0.0, 0.05)]
CONFIGS = [SamplingParams(), *WARPED]  # greedy, then every warper combination


def random_logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    x = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale
    x[x == 0] = 0.5  # never zero
    return x


def make_rows(num_rows: int, seed: int, configs=CONFIGS) -> list[SampleRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_rows):
        options = OutputOptions(logprobs=i % 5 != 4, top_logprobs=int(rng.integers(0, WIDTH + 1)))
        rows.append(SampleRow(params=configs[(i + seed) % len(configs)], options=options,
                              seed=int(rng.integers(0, 2**64, dtype=np.uint64)),
                              position=int(rng.integers(0, 2**40)), history=[], output_tokens=[]))
    return rows


def run_sampler(lib, stream, logits: torch.Tensor, rows, top_n: int = WIDTH, processed: torch.Tensor | None = None):
    """logits, processed: [N, V] float32 on the host (processed: apply_penalties' output, or None).
    Returns tokens, logprobs, top_ids [N, WIDTH], top_logprobs [N, WIDTH] on the host."""
    num_rows = logits.shape[0]
    x = logits.to(DEVICE)
    penalised = None if processed is None else processed.to(DEVICE)
    params = torch.from_numpy(pack_sampling_params(rows)).to(DEVICE)
    tokens = torch.full((num_rows,), -7, dtype=torch.int32, device=DEVICE)
    logprobs = torch.full((num_rows,), POISON, device=DEVICE)
    top_ids = torch.full((num_rows, WIDTH), -9, dtype=torch.int32, device=DEVICE)
    top_logprobs = torch.full((num_rows, WIDTH), POISON, device=DEVICE)
    torch.cuda.synchronize()
    sample_rows(lib, stream, DeviceTensor.from_torch(x), DeviceTensor.from_torch(params),
                DeviceTensor.from_torch(tokens), DeviceTensor.from_torch(logprobs),
                DeviceTensor.from_torch(top_ids) if top_n else None,
                DeviceTensor.from_torch(top_logprobs) if top_n else None, top_n,
                processed=None if penalised is None else DeviceTensor.from_torch(penalised))
    stream.sync()
    return tokens.cpu().numpy(), logprobs.cpu().numpy(), top_ids.cpu().numpy(), top_logprobs.cpu().numpy()


def run_penalties(lib, stream, logits: torch.Tensor, rows) -> torch.Tensor:
    """apply_penalties over logits [N, V] (host) into a NaN-poisoned buffer; returned on the host."""
    params = torch.from_numpy(pack_sampling_params(rows)).to(DEVICE)
    lists = pack_penalties(rows, logits.shape[1])
    offsets, entries, biases = (torch.from_numpy(a).to(DEVICE) for a in (lists.entry_offsets, lists.entries,
                                                                         lists.biases))
    x = logits.to(DEVICE)
    processed = torch.full_like(x, float("nan"))
    torch.cuda.synchronize()
    apply_penalties(lib, stream, DeviceTensor.from_torch(processed), DeviceTensor.from_torch(x),
                    DeviceTensor.from_torch(params), DeviceTensor.from_torch(offsets),
                    DeviceTensor.from_torch(entries), DeviceTensor.from_torch(biases))
    stream.sync()
    return processed.cpu()


def canonical_order(values: np.ndarray) -> np.ndarray:
    """Ids by value descending, ties by lower id."""
    return np.lexsort((np.arange(len(values)), -values.astype(np.float64)))


def rule_token_and_margin(x: np.ndarray, params: SamplingParams, u: float) -> tuple[int, float]:
    """sampler.py's rule in float64 over the float32 s of the penalised row x; returns the token and the smallest
    relative distance of any of its decisions (u * T, top_p and min_p against running masses or p) from its
    boundary. top_p compares a mass with a constant, so the CPU softmax's normalisation error counts there."""
    order = canonical_order(x)
    with np.errstate(over="ignore", invalid="ignore"):  # clamped rows: -FLOAT_MAX - max / t is -inf, as on the CPU
        s = (x - x.max()) / np.float32(params.temperature)  # float32, as the CPU computes it
    if params.top_k:
        s[x < x[order[min(params.top_k, len(x)) - 1]]] = -np.inf
    p = np.exp(s.astype(np.float64))
    p /= p.sum()
    normalisation = abs(torch.softmax(torch.from_numpy(s), dim=-1).double().sum().item() - 1.0)
    margins = []
    keep = p > 0
    if params.min_p > 0:
        threshold = float(np.float32(params.min_p)) * p.max()
        margins.append(float(np.min(np.abs(p[keep] / threshold - 1.0))))
        keep &= p >= threshold
    kept = order[keep[order]]
    running = np.cumsum(p[kept])
    if params.top_p < 1.0:
        cut = min(int(np.searchsorted(running, params.top_p, side="left")), len(kept) - 1)
        near = abs(running[cut] - params.top_p) if cut == 0 else min(abs(running[cut] - params.top_p),
                                                                      abs(running[cut - 1] - params.top_p))
        margins.append(near / params.top_p - 3 * normalisation)
        kept, running = kept[:cut + 1], running[:cut + 1]
    target = u * running[-1]
    j = min(int(np.searchsorted(running, target, side="right")), len(kept) - 1)
    near = running[j] - target if j == 0 else min(running[j] - target, target - running[j - 1])
    margins.append(near / running[-1])
    return int(kept[j]), min(margins)


def check_tokens(tokens: np.ndarray, processed: torch.Tensor, rows, cpu_tokens: list[int]) -> None:
    """processed: [N, V] the rows the tokens were chosen from (host)."""
    borderline, sampled = 0, 0
    for i, row in enumerate(rows):
        x = processed[i].numpy()
        if row.params.is_greedy:
            assert tokens[i] == cpu_tokens[i] == int(torch.argmax(processed[i])), f"row {i}: greedy"
            continue
        sampled += 1
        token, margin = rule_token_and_margin(x, row.params, uniform(row.seed, row.position))
        if margin > MARGIN:
            assert token == cpu_tokens[i], f"row {i}: the float64 model of the rule disagrees with sample()"
            assert tokens[i] == cpu_tokens[i], f"row {i} {row.params}: kernel {tokens[i]}, cpu {cpu_tokens[i]}"
        else:  # within rounding of a boundary: at most a neighbour in the canonical order
            borderline += 1
            ranks = np.empty(len(x), dtype=np.int64)
            ranks[canonical_order(x)] = np.arange(len(x))
            assert abs(int(ranks[tokens[i]]) - int(ranks[cpu_tokens[i]])) <= 2, f"row {i}: far from the cpu token"
    assert borderline <= max(2, sampled // 4), f"{borderline} of {sampled} sampled rows are borderline"


def check_logprobs(logprobs, top_ids, top_logprobs, logits: torch.Tensor, rows, tokens, top_n: int) -> None:
    """Against float64 log_softmax of the raw rows (host)."""
    reference = torch.log_softmax(logits.double(), dim=-1).numpy()
    for i, row in enumerate(rows):
        if row.options.logprobs:
            assert abs(logprobs[i] - reference[i, tokens[i]]) <= 1e-5, f"row {i}: logprob"
        else:
            assert np.isnan(logprobs[i]), f"row {i}: a logprob nobody asked for"
        n = min(row.options.top_logprobs, top_n)
        ids, values = top_ids[i], top_logprobs[i]
        expected = canonical_order(reference[i])[:n]
        assert len(set(ids[:n].tolist())) == n, f"row {i}: repeated top ids"
        for got, want in zip(ids[:n], expected):  # ties by lower id; float32 rounding may merge near-ties
            assert got == want or (reference[i, got] != reference[i, want]
                                   and abs(reference[i, got] - reference[i, want]) <= NEAR_TIE), f"row {i}: top ids"
        np.testing.assert_allclose(values[:n], reference[i, ids[:n]], rtol=0, atol=1e-5)
        assert (ids[n:top_n] == -1).all() and np.isnan(values[n:top_n]).all(), f"row {i}: padding"
        assert (ids[top_n:] == -9).all() and (values[top_n:] == POISON).all(), f"row {i}: columns past top_n"


@gpu
@pytest.mark.parametrize("num_rows", [1, 7, 64])
@pytest.mark.parametrize("vocab_size", [256, 49152, 128256])
def test_tokens_and_logprobs_match_the_cpu_sampler(kernel_library, stream, num_rows, vocab_size):
    seed = num_rows * 1000 + vocab_size
    logits, rows = random_logits(num_rows, vocab_size, seed), make_rows(num_rows, seed)
    tokens, logprobs, top_ids, top_logprobs = run_sampler(kernel_library, stream, logits, rows)
    cpu = sample(logits, rows)
    check_tokens(tokens, logits, rows, cpu.tokens)
    check_logprobs(logprobs, top_ids, top_logprobs, logits, rows, tokens, WIDTH)


@gpu
@pytest.mark.parametrize("kind", ["ties", "equal", "bf16"])
def test_tied_rows_follow_the_rule(kernel_library, stream, kind):
    # ties: ~4000 tokens per value (the tie walk in id order); equal: one value; bf16: ties of rounded logits.
    # V odd: no running mass of equal p lands exactly on top_p = 0.5
    generator, vocab_size = torch.Generator().manual_seed(11), 49151
    if kind == "ties":
        logits = torch.randint(1, 13, (24, vocab_size), generator=generator).float() * 0.5
    elif kind == "equal":
        logits = torch.full((24, vocab_size), 1.5)
    else:
        logits = (torch.randn(24, vocab_size, generator=generator) * 3).bfloat16().float()
    rows = make_rows(24, 5)
    tokens, logprobs, top_ids, top_logprobs = run_sampler(kernel_library, stream, logits, rows)
    check_tokens(tokens, logits, rows, sample(logits, rows).tokens)
    check_logprobs(logprobs, top_ids, top_logprobs, logits, rows, tokens, WIDTH)


def penalised_rows(num_rows: int, vocab_size: int, seed: int) -> list[SampleRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_rows):
        output = rng.integers(0, vocab_size, int(rng.integers(0, 300))).tolist()
        history = rng.integers(-3, vocab_size + 3, int(rng.integers(0, 500))).tolist() + output  # ids past V skip
        bias = tuple((int(rng.integers(0, vocab_size)), float(rng.normal() * 4))
                     for _ in range(int(rng.integers(1, 6))))
        bias += ((bias[0][0], 1.25), (bias[0][0], -0.375))  # a repeated id: added in order
        params = [
            SamplingParams(),
            SamplingParams(temperature=0.9, repetition_penalty=1.3),
            SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
            SamplingParams(temperature=1.1, top_k=40, repetition_penalty=0.8, frequency_penalty=0.3,
                           presence_penalty=1.1, logit_bias=bias),
            SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, logit_bias=bias),
            SamplingParams(temperature=1.0, logit_bias=((1, 1e38), (1, 1e38), (2, -3e38))),  # overflow, clamped
        ][i % 6]
        options = OutputOptions(logprobs=True, top_logprobs=3)
        rows.append(SampleRow(params=params, options=options, seed=int(rng.integers(0, 2**63)),
                              position=int(rng.integers(0, 4096)), history=history, output_tokens=output))
    return rows


@gpu
def test_penalties_match_the_cpu_bit_for_bit(kernel_library, stream):
    num_rows, vocab_size = 24, 49152
    logits = random_logits(num_rows, vocab_size, seed=21)
    rows = penalised_rows(num_rows, vocab_size, seed=21)
    for i, value in ((1, -torch.inf), (3, 3e38), (4, -3e38)):  # penalised rows: inf and overflow, then the clamp
        logits[i, 6 + i] = value
        rows[i].history = [*rows[i].history, 6 + i]
        rows[i].output_tokens = [*rows[i].output_tokens, 6 + i]
        rows[i].options = OutputOptions()  # float32 logprobs of a row spanning 3e38 lose all digits
    processed = run_penalties(kernel_library, stream, logits, rows)
    expected = logits.clone()
    for i, row in enumerate(rows):
        if row.params.has_penalties:
            cpu_sampler.apply_penalties(expected[i], row)
            torch.testing.assert_close(processed[i], expected[i], rtol=0, atol=0, equal_nan=True)
        else:
            assert processed[i].isnan().all(), f"row {i} has no penalties and must not be written"

    tokens, logprobs, top_ids, top_logprobs = run_sampler(kernel_library, stream, logits, rows, top_n=3,
                                                          processed=processed)
    check_tokens(tokens, expected, rows, sample(logits, rows).tokens)
    check_logprobs(logprobs, top_ids, top_logprobs, logits, rows, tokens, 3)


@gpu
def test_rows_the_cpu_cannot_sample(kernel_library, stream):
    logits = random_logits(8, 1000, seed=3)
    logits[0:2, 10], logits[0:2, 20] = float("nan"), float("nan")
    logits[2:4, 30], logits[2:4, 40] = torch.inf, torch.inf
    logits[4:6] = -torch.inf
    greedy, warped = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)
    rows = [SampleRow(params=greedy if i % 2 == 0 else warped,
                      options=OutputOptions(logprobs=True, top_logprobs=4), seed=i, position=i, history=[],
                      output_tokens=[]) for i in range(8)]
    tokens, logprobs, top_ids, top_logprobs = run_sampler(kernel_library, stream, logits, rows, top_n=4)
    # greedy rows: torch.argmax (NaN first); sampled rows: -1 where the CPU sampler raises
    assert tokens[:6].tolist() == [10, -1, 30, -1, 0, -1]
    assert tokens[6] == int(torch.argmax(logits[6])) and 0 <= tokens[7] < 1000
    assert np.isnan(logprobs[:6]).all() and not np.isnan(logprobs[6:]).any()
    assert (top_ids[:6, :4] == -1).all() and np.isnan(top_logprobs[:6, :4]).all()
    assert (top_ids[:, 4:] == -9).all() and (top_logprobs[:, 4:] == POISON).all()


@gpu
def test_without_top_logprobs(kernel_library, stream):
    logits, rows = random_logits(5, 3001, seed=4), make_rows(5, 4)  # V odd: the unaligned load path
    tokens, logprobs, top_ids, top_logprobs = run_sampler(kernel_library, stream, logits, rows, top_n=0)
    check_tokens(tokens, logits, rows, sample(logits, rows).tokens)
    assert (top_ids == -9).all() and (top_logprobs == POISON).all()
    check_logprobs(logprobs, top_ids, top_logprobs, logits, rows, tokens, 0)


@gpu
@pytest.mark.parametrize("vocab_size", [1, 3001, 256206])
def test_widen_rows_is_torchs_float(kernel_library, stream, vocab_size):
    """The LM head's bf16 rows (a column view of padded rows, NaN and infinities among them) as float32, exactly
    torch's .float(); nothing written past the row."""
    logits = (torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(vocab_size)) * 4).bfloat16()
    logits[0, 0], logits[1, -1], logits[2, vocab_size // 2] = float("nan"), torch.inf, -torch.inf
    wide = torch.zeros(5, vocab_size + 64, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :vocab_size] = logits.to(DEVICE)
    out = torch.full((5, vocab_size + 3), POISON, device=DEVICE)
    torch.cuda.synchronize()
    sampling_launchers.widen_rows(kernel_library, stream, DeviceTensor.from_torch(out[:, :vocab_size]),
                                  DeviceTensor.from_torch(wide[:, :vocab_size]))
    stream.sync()
    assert torch.equal(out[:, :vocab_size].cpu().view(torch.int32), logits.float().view(torch.int32))   # bits
    assert (out[:, vocab_size:] == POISON).all()
