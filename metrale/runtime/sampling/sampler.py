"""Choose each sequence's next token from a batch of logits rows, and report logprobs.

The rule, which the CUDA sampler kernel implements too (x: one row of logits, in float32):
 1. Penalties, in HF transformers' order: repetition_penalty r over the set of history ids
    (x < 0: x * r, else x / r); then x -= frequency_penalty * count + presence_penalty * (count > 0),
    counts over output_tokens; then x += logit_bias (repeated ids add up).
 2. temperature == 0: the token is argmax(x), ties to the lowest id. Done.
 3. s = (x - max(x)) / temperature (the shift changes no probability; it keeps s finite).
    Canonical order: s descending, ties by lower id.
    top_k > 0: drop tokens with s < the top_k-th largest s (HF TopKLogitsWarper: ties at the cut stay).
    p = softmax(s) over what is left (float32); tokens with p == 0 are dropped.
    top_p < 1: keep a token while the float64 sum of p before it (canonical order) is < top_p
      (HF TopPLogitsWarper: the smallest head whose mass reaches top_p; the first token always stays).
    min_p > 0: drop tokens with p < min_p * max(p) (HF MinPLogitsWarper).
    K = the kept tokens, a head of the canonical order.
 4. u = philox.uniform(seed, position), in (0, 1). T = float64 sum of p over K.
    c_j = float64 running sum of p over K in canonical order. The token is the first j with
    c_j > u * T, or the last token of K where rounding leaves none.
Logprobs are log_softmax of the raw row: the model's own distribution, before step 1.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from metrale.runtime.sampling.params import OutputOptions, SamplingParams
from metrale.runtime.sampling.philox import uniform

FIRST_HEAD = 128  # canonical-order tokens walked first; doubled until the choice is inside


@dataclass
class SampleRow:
    """One sequence's row of the logits."""

    params: SamplingParams
    options: OutputOptions
    seed: int  # resolved uint64 seed
    position: int  # index the sampled token will have (= tokens the sequence holds); the Philox counter
    history: Sequence[int]  # prompt + generated tokens, for repetition_penalty
    output_tokens: Sequence[int]  # generated tokens only, for presence/frequency penalties


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # NaN where options.logprobs is False
    top_logprobs: list[tuple[list[int], list[float]] | None]  # (ids, logprobs), best first; None where not asked
    logits: list[torch.Tensor | None]  # raw float32 row (vocab,) where return_logits


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """logits: [N, V], any float dtype; rows: N, in the same order."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    raw = logits.float()
    processed = raw
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if penalised:
        processed = raw.clone()
        for i in penalised:
            apply_penalties(processed[i], rows[i])
    tokens = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if greedy:
        # one argmax for every greedy row; argmax returns the first (lowest) id among ties
        for i, token in zip(greedy, processed[greedy].argmax(dim=-1).tolist()):
            tokens[i] = token
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if sampled:
        for i, token in zip(sampled, _sample_rows(processed[sampled], [rows[i] for i in sampled])):
            tokens[i] = token
    return _outputs(raw, rows, tokens)


def apply_penalties(row: torch.Tensor, sample_row: SampleRow) -> None:
    """row: [V] float32, changed in place by repetition, frequency/presence penalties and logit_bias."""
    params = sample_row.params
    vocab_size = row.shape[0]
    if params.repetition_penalty != 1.0 and len(sample_row.history):
        ids = _token_ids(sample_row.history, vocab_size).unique()
        scores = row[ids]
        row[ids] = torch.where(scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and len(sample_row.output_tokens):
        ids, counts = _token_ids(sample_row.output_tokens, vocab_size).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        row.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.tensor(biases, dtype=torch.float32))


def _token_ids(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    # ids past the logits row (an embedding larger than lm_head) can never be sampled: skip them, as HF does
    ids = torch.as_tensor(tokens, dtype=torch.long)
    return ids[(ids >= 0) & (ids < vocab_size)]


def _sample_rows(x: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """x: [M, V] float32 penalised logits of the rows that sample (temperature > 0); a copy, changed in place."""
    vocab_size = x.shape[1]
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32)
    s = x.sub_(x.amax(dim=-1, keepdim=True)).div_(temperature[:, None])
    top_k = torch.tensor([min(row.params.top_k, vocab_size) for row in rows])
    if bool(top_k.any()):
        # [M, 1] the top_k-th largest s; -inf where top_k is off
        kth = torch.topk(s, int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        kth[top_k == 0] = -torch.inf
        s = s.masked_fill_(s < kth, -torch.inf)
    p = torch.softmax(s, dim=-1)
    min_p = torch.tensor([row.params.min_p for row in rows], dtype=torch.float32)
    keep = p >= (min_p[:, None] * p.amax(dim=-1, keepdim=True)).clamp(min=torch.finfo(torch.float32).tiny)
    head = min(FIRST_HEAD, vocab_size)
    best = torch.topk(s, min(head + 1, vocab_size), dim=-1)  # [M, head + 1], first heads of all rows at once
    return [_choose(s[m], p[m], keep[m], canonical_head(s[m], head, best.values[m], best.indices[m]),
                    row.params.top_p, uniform(row.seed, row.position))
            for m, row in enumerate(rows)]


def _choose(s: torch.Tensor, p: torch.Tensor, keep: torch.Tensor, order: torch.Tensor, top_p: float, u: float) -> int:
    """Inverse-CDF choice over K. s, p, keep: [V], keep = p > 0 and min_p; order: a canonical head of s."""
    num_keep = int(keep.sum())
    if num_keep == 0:
        raise ValueError("a logits row has no finite maximum (NaN or +inf logits): nothing to sample")
    kept_len = num_keep if top_p >= 1.0 else None  # length of K once top_p's cut is known
    total = None
    head = len(order)
    while True:
        order = order[keep[order]]  # keep is a head of the canonical order, so this stays a head of K
        probs = p[order].double().numpy()
        cumulative = np.cumsum(probs)
        if kept_len is None:
            before = np.concatenate(([0.0], cumulative[:-1]))
            inside = int(np.count_nonzero(before < top_p))
            if inside < len(order) or len(order) == num_keep:
                kept_len = inside
        if kept_len is not None:
            if total is None:
                total = _kept_mass(p, keep, order, kept_len)
            limit = min(kept_len, len(order))
            index = int(np.searchsorted(cumulative[:limit], u * total, side="right"))
            if index < limit:
                return int(order[index])
            if limit == kept_len:
                return int(order[limit - 1])
        # ends: at the full vocabulary the order holds all of K
        head = min(2 * head, s.shape[0])
        order = canonical_head(s, head)


def _kept_mass(p: torch.Tensor, keep: torch.Tensor, order: torch.Tensor, kept_len: int) -> float:
    """T: float64 sum of p over K, the head of `keep` in canonical order of length kept_len."""
    if kept_len <= len(order):
        return float(p[order[:kept_len]].double().sum())
    return float(p[keep].double().sum())


def canonical_head(values: torch.Tensor, n: int, best: torch.Tensor | None = None,
                   best_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Ids of the n largest values (more where ties straddle the n-th), largest first, ties by lower id.

    values: [V]; best, best_ids: topk(values, k) for some k > n, where the caller has it already.
    """
    if n >= values.shape[0]:
        return torch.sort(values, descending=True, stable=True).indices
    if best is None:
        best, best_ids = torch.topk(values, n + 1)
    if best[n] < best[n - 1]:
        ids = best_ids[:n].sort().values
    else:
        ids = torch.nonzero(values >= best[n - 1]).squeeze(1)  # ties straddle the cut: take them all
    # ids ascending, so the stable sort leaves ties in id order
    return ids[torch.sort(values[ids], descending=True, stable=True).indices]


def _outputs(raw: torch.Tensor, rows: list[SampleRow], tokens: list[int]) -> SampleResult:
    """logprobs, top_logprobs and raw logits, from raw: [N, V] float32."""
    result = SampleResult(tokens=tokens, logprobs=[float("nan")] * len(rows),
                          top_logprobs=[None] * len(rows), logits=[None] * len(rows))
    asked = [i for i, row in enumerate(rows) if row.options.logprobs or row.options.top_logprobs]
    if asked:
        logprobs = torch.log_softmax(raw if len(asked) == len(rows) else raw[asked], dim=-1)  # [len(asked), V]
        top_n = max(rows[i].options.top_logprobs for i in asked)
        best = torch.topk(logprobs, min(top_n + 1, logprobs.shape[1]), dim=-1) if top_n else None
        for m, i in enumerate(asked):
            options = rows[i].options
            if options.logprobs:
                result.logprobs[i] = float(logprobs[m, tokens[i]])
            if options.top_logprobs:
                n = options.top_logprobs
                ids = canonical_head(logprobs[m], n, best.values[m], best.indices[m])[:n]
                result.top_logprobs[i] = (ids.tolist(), logprobs[m, ids].tolist())
    for i, row in enumerate(rows):
        if row.options.return_logits:
            result.logits[i] = raw[i].clone()
    return result
