"""Choose each sequence's next token from a batch of logits rows, and report logprobs.

The rule, which the CUDA sampler kernel implements too (x: one row of logits, in float32):
 1. Penalties, in HF transformers' order: repetition_penalty r over the set of history ids
    (x < 0: x * r, else x / r); then x -= frequency_penalty * count + presence_penalty * (count > 0),
    counts over output_tokens; then x += logit_bias (repeated ids add up).
 2. temperature == 0: the token is argmax(x), ties to the lowest id. Done.
 3. Canonical order: x descending, ties by lower id (temperature and the shift below keep this order).
    top_k > 0: drop tokens with x < the top_k-th largest x (HF TopKLogitsWarper: ties at the cut stay).
    s = (x - max(x)) / temperature: the shift changes no probability and keeps s finite.
    p = softmax(s) over what is left (float32); tokens with p == 0 are dropped.
    top_p < 1: keep a token while the float64 sum of p before it (canonical order) is < top_p
      (HF TopPLogitsWarper: the smallest head whose mass reaches top_p; the first token always stays).
    min_p > 0: drop tokens with p < min_p * max(p) (HF MinPLogitsWarper).
    K = the kept tokens, a head of the canonical order.
 4. u = philox.uniform(seed, position), in (0, 1). T = float64 sum of p over K.
    c_j = float64 running sum of p over K in canonical order. The token is the first j with
    c_j > u * T, or the last token of K where rounding leaves none.
Backends agree token for token except where u * T falls within float rounding of some c_j.
Here the walk reads a canonical head first and, on flat rows, sums p per bucket of s to skip ahead.
Logprobs are log_softmax of the raw row: the model's own distribution, before step 1.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from metrale.runtime.sampling.params import OutputOptions, SamplingParams
from metrale.runtime.sampling.philox import uniform

FLOAT32_MAX = torch.finfo(torch.float32).max
FIRST_HEAD = 128  # canonical-order tokens walked first: the choice is in them for all but flat rows
NUM_BUCKETS = 4096  # s-buckets that narrow the walk on flat rows


@dataclass(slots=True)
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
        x = processed if len(sampled) == len(rows) else processed[sampled]
        for i, token in zip(sampled, _sample_rows(x, [rows[i] for i in sampled])):
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
    # Extreme penalties or biases overflow to +-inf; keep the row finite so a client's values cannot break it.
    row.clamp_(-FLOAT32_MAX, FLOAT32_MAX)


def _token_ids(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    # ids past the logits row (an embedding larger than lm_head) can never be sampled: skip them, as HF does
    ids = torch.as_tensor(tokens, dtype=torch.long)
    return ids[(ids >= 0) & (ids < vocab_size)]


def _sample_rows(x: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """x: [M, V] float32 penalised logits of the rows that sample (temperature > 0)."""
    vocab_size = x.shape[1]
    top_k = torch.tensor([min(row.params.top_k, vocab_size) for row in rows])
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32)
    s = (x - x.amax(dim=-1, keepdim=True)).div_(temperature[:, None])
    if bool(top_k.any()):
        # [M, 1] the top_k-th largest x; -inf where top_k is off
        kth = torch.topk(x, int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        kth[top_k == 0] = -torch.inf
        s.masked_fill_(x < kth, -torch.inf)
    p = torch.softmax(s, dim=-1)
    min_p = torch.tensor([row.params.min_p for row in rows], dtype=torch.float32)
    keep = (p > 0) & (p >= min_p[:, None] * p.amax(dim=-1, keepdim=True))
    # [M, FIRST_HEAD + 1]: the first canonical heads of all rows from one topk
    best_values, best_ids = (t.numpy() for t in torch.topk(x, min(FIRST_HEAD + 1, vocab_size), dim=-1))
    tokens = []
    for m, row in enumerate(rows):
        x_row, s_row, p_row, keep_row = x[m].numpy(), s[m].numpy(), p[m].numpy(), keep[m].numpy()
        num_keep = np.count_nonzero(keep_row)
        if num_keep == 0:
            raise ValueError("a logits row has no finite maximum (NaN or +inf logits): nothing to sample")
        head = canonical_head(x_row, min(FIRST_HEAD, num_keep), best_values[m], best_ids[m])
        draw = _Draw(x_row, s_row, p_row, head)
        tokens.append(draw.choose(keep_row, row.params.top_p, uniform(row.seed, row.position)))
    return tokens


@dataclass
class _Draw:
    """One row's inverse-CDF draw. x, s, p: [V] penalised logits, shifted and scaled s, softmax p."""

    x: np.ndarray
    s: np.ndarray
    p: np.ndarray
    head: np.ndarray  # a head of the canonical order of x

    def choose(self, keep: np.ndarray, top_p: float, u: float) -> int:
        """keep: [V], p > 0 and min_p."""
        kept = keep
        if top_p < 1.0:
            # K ends at the first token whose running sum reaches top_p
            last = self.first_past(keep, float(np.nextafter(top_p, -1.0)))
            after_last = (self.x < self.x[last]) | ((self.x == self.x[last]) & (np.arange(len(self.x)) > last))
            kept = keep & ~after_last
        total = float(np.sum(self.p, where=kept, dtype=np.float64))
        return self.first_past(kept, u * total)

    def first_past(self, mask: np.ndarray, target: float) -> int:
        """The first token of mask (canonical order) whose float64 running sum of p is > target; else the last."""
        order = self.head[mask[self.head]]
        cumulative = np.cumsum(self.p[order], dtype=np.float64)
        index = int(np.searchsorted(cumulative, target, side="right"))
        if index < len(order):
            return int(order[index])
        if len(order) == np.count_nonzero(mask):
            return int(order[-1])
        return self._first_past_by_buckets(mask, target)

    def _first_past_by_buckets(self, mask: np.ndarray, target: float) -> int:
        """first_past where the crossing lies past the head (flat rows): sum p per s-bucket, sort one bucket."""
        lowest = float(np.min(self.s, where=mask, initial=0.0))  # s <= 0: the top token has s == 0
        before = 0.0
        if lowest == 0.0:
            ids = np.flatnonzero(mask)  # all of mask is tied at the top of s
        else:
            # bucket 0 holds the largest s; s is monotone in x, so buckets follow the canonical order
            # in float64: a tiny lowest (a flat row at a high temperature) would overflow float32's scale
            scaled = np.floor(self.s.astype(np.float64) * ((NUM_BUCKETS - 1) / lowest))
            bucket = np.clip(scaled, 0, NUM_BUCKETS - 1).astype(np.intp)
            mass = np.cumsum(np.bincount(bucket, weights=self.p * mask, minlength=NUM_BUCKETS))
            crossed = min(int(np.searchsorted(mass, target, side="right")), NUM_BUCKETS - 1)
            while crossed and mass[crossed] == mass[crossed - 1]:
                crossed -= 1  # rounding left target past the last bucket: back off to one with tokens
            before = float(mass[crossed - 1]) if crossed else 0.0
            ids = np.flatnonzero(mask & (bucket == crossed))
        order = ids[np.argsort(-self.x[ids], kind="stable")]  # ids ascending: ties stay in id order
        cumulative = before + np.cumsum(self.p[order], dtype=np.float64)
        return int(order[min(int(np.searchsorted(cumulative, target, side="right")), len(order) - 1)])


def canonical_head(values: np.ndarray, n: int, best: np.ndarray | None = None,
                   best_ids: np.ndarray | None = None) -> np.ndarray:
    """Ids of the n largest values (more where ties straddle the n-th), largest first, ties by lower id.

    values: [V]; best, best_ids: topk(values, k) for some k > n, largest first, where the caller has it.
    """
    if n >= values.shape[0]:
        return np.argsort(-values, kind="stable")
    if best is None:
        best, best_ids = (t.numpy() for t in torch.topk(torch.from_numpy(values), n + 1))
    if best[n] < best[n - 1]:
        ids = np.sort(best_ids[:n])
    else:
        ids = np.flatnonzero(values >= best[n - 1])  # ties straddle the cut: take them all
    return ids[np.argsort(-values[ids], kind="stable")]  # ids ascending: ties stay in id order


def _outputs(raw: torch.Tensor, rows: list[SampleRow], tokens: list[int]) -> SampleResult:
    """logprobs, top_logprobs and raw logits, from raw: [N, V] float32."""
    result = SampleResult(tokens=tokens, logprobs=[float("nan")] * len(rows),
                          top_logprobs=[None] * len(rows), logits=[None] * len(rows))
    asked = [i for i, row in enumerate(rows) if row.options.logprobs or row.options.top_logprobs]
    if asked:
        logprobs = torch.log_softmax(raw if len(asked) == len(rows) else raw[asked], dim=-1)  # [len(asked), V]
        top_n = max(rows[i].options.top_logprobs for i in asked)
        if top_n:
            best = torch.topk(logprobs, min(top_n + 1, logprobs.shape[1]), dim=-1)
            best_values, best_ids = best.values.numpy(), best.indices.numpy()
        for m, i in enumerate(asked):
            options = rows[i].options
            if options.logprobs:
                result.logprobs[i] = float(logprobs[m, tokens[i]])
            if options.top_logprobs:
                n = options.top_logprobs
                row_logprobs = logprobs[m].numpy()
                ids = canonical_head(row_logprobs, n, best_values[m], best_ids[m])[:n]
                result.top_logprobs[i] = (ids.tolist(), row_logprobs[ids].tolist())
    for i, row in enumerate(rows):
        if row.options.return_logits:
            result.logits[i] = raw[i].clone()
    return result
