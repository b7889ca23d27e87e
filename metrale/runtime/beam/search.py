"""Beam search for a group of requests with the same num_beams, step for step as transformers'
`GenerationMixin._beam_search` (5.x) runs each of them alone, so the hypotheses and their scores are the ones
`generate(num_beams=...)` returns for each request.

Per step, from the running beams' logits: log-softmax, the logits processors (no_repeat_ngram_size,
min_new_tokens: banned_tokens() lists what they set to -inf), add each beam's running score, keep the best
max(2, 1 + #eos) x num_beams continuations over all beams; the best num_beams of those that did not stop (EOS
or max_length) run on, and those that did stop among the first num_beams compete with the finished hypotheses,
scored with the length penalty. A request's
search ends when no running beam can improve on its finished ones (transformers' heuristic, which depends on
early_stopping), when early_stopping is TRUE and num_beams hypotheses are finished, or when every continuation
stopped; it then leaves the group (in transformers its hypotheses stop changing at that point).

The vocabulary-wide part, log-softmax, the bans and each beam's own best `keep` continuations, is the backend's
(Ops.beam_candidates, on the device where there is one): the best `keep` over all of a request's beams are among
its beams' own best `keep` each, and a running score added to a beam's candidates keeps their order. So step()
takes those candidates, and adds the running scores to the same float32 log-probabilities transformers does.

Requests run as rows of [requests, beams, ...] tensors: the arithmetic is transformers' elementwise and
per-row (float32, the -1e9 offsets, length penalties computed in double and applied in float32, top-k over a
row), so equal logits give equal scores, bit for bit, whatever else is in the group. num_beams=1 is greedy search,
as in transformers.
"""

import numpy as np
import torch

from metrale.runtime.beam.candidates import best_first
from metrale.runtime.beam.params import BeamParams

NEG = -1.0e9


class BeamGroup:
    def __init__(self, params: list[BeamParams], prompts: list[list[int]], eos_token_ids: tuple[int, ...],
                 fill_token: int):
        """prompts: each request's tokens before the first generated one (a decoder-only prompt, or an
        encoder-decoder's decoder start and prefix); it generates up to max_new_tokens past them."""
        k = params[0].num_beams
        assert all(p.num_beams == k for p in params)
        self.params = list(params)
        self.eos = torch.tensor(eos_token_ids, dtype=torch.int64)
        self.keep = max(2, 1 + len(eos_token_ids)) * k
        self.top_mask = torch.from_numpy(np.arange(self.keep) < k)
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        self.prompt_len = torch.from_numpy(lengths)
        self.max_length = torch.from_numpy(lengths + np.fromiter((p.max_new_tokens for p in params), dtype=np.int64,
                                                                 count=len(params)))
        self.steps = 0          # tokens generated so far, the same for every request of the group
        running = np.full((len(prompts), k, int(self.max_length.max())), fill_token, dtype=np.int64)
        if len(prompts) and (lengths == lengths[0]).all():
            running[:, :, :lengths[0]] = np.asarray(prompts, dtype=np.int64)[:, None, :]
        else:
            for row, (prompt, n) in enumerate(zip(prompts, lengths.tolist())):
                running[row, :, :n] = prompt
        self.running = torch.from_numpy(running)
        scores = np.zeros((len(prompts), k), dtype=np.float32)
        scores[:, 1:] = NEG
        self.running_scores = torch.from_numpy(scores)
        # Each request's finished hypotheses: num_beams slots, -1e9 while empty.
        self.sequences = self.running.clone()
        self.lengths = torch.zeros(len(prompts), k, dtype=torch.int64)
        self.scores = torch.full((len(prompts), k), NEG)
        self.finished = torch.zeros(len(prompts), k, dtype=torch.bool)
        self.improvable = torch.ones(len(prompts), dtype=torch.bool)

    @property
    def num_beams(self) -> int:
        return self.params[0].num_beams

    @property
    def cur_len(self) -> torch.Tensor:
        """[requests] tokens each request's running beams hold (prompt included)."""
        return self.prompt_len + self.steps

    def last_tokens(self) -> torch.Tensor:
        """[requests, beams] each running beam's newest token."""
        return self.running.gather(2, (self.cur_len - 1)[:, None, None].expand(-1, self.num_beams, 1))[..., 0]

    def step(self, values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """values, ids [requests, beams, >= keep]: each running beam's best continuations (Ops.beam_candidates
        over its logits with banned_tokens() banned), best first. Returns, for each request's new running beams,
        the index of the beam each continues ([requests, beams]; their tokens: last_tokens()), and which
        requests' searches ended ([requests] bool)."""
        if self.num_beams == 1:
            return self._greedy_step(values[:, :, 0], ids[:, :, 0])
        rows, k, cur = len(self.params), self.num_beams, self.cur_len
        scores = (values[:, :, :self.keep] + self.running_scores[:, :, None]).reshape(rows, -1)
        top_log_probs, top_indices = best_first(scores, self.keep)
        top_beams = top_indices // self.keep
        top_ids = ids[:, :, :self.keep].reshape(rows, -1).gather(1, top_indices)
        top_sequences = self.running.gather(1, top_beams[:, :, None].expand(-1, -1, self.running.shape[2])).clone()
        top_sequences.scatter_(2, cur[:, None, None].expand(-1, self.keep, 1), top_ids[:, :, None])
        stops = torch.isin(top_ids, self.eos) | (cur + 1 >= self.max_length)[:, None]

        # The next running beams: the best that did not stop.
        running_log_probs = top_log_probs + stops.to(torch.float32) * NEG
        chosen = best_first(running_log_probs, k)[1]
        self.running = top_sequences.gather(1, chosen[:, :, None].expand(-1, -1, top_sequences.shape[2]))
        self.running_scores = running_log_probs.gather(1, chosen)
        parents = top_beams.gather(1, chosen)

        # Finished hypotheses: those of the first num_beams continuations that stopped, if they beat a kept one.
        # (transformers also pushes every candidate down by -1e9 once its item can no longer improve or, with
        # early_stopping TRUE, is full: that keeps a finished item frozen while others run. Here the request has
        # left by then.)
        just_finished = stops & self.top_mask
        candidates = self._penalized(top_log_probs, [self.steps + 1] * rows)
        candidates += (~just_finished) * NEG
        scores = torch.cat((self.scores, candidates), dim=1)
        best = best_first(scores, k)[1]
        self.sequences = torch.cat((self.sequences, top_sequences), dim=1).gather(
            1, best[:, :, None].expand(-1, -1, self.sequences.shape[2]))
        self.scores = scores.gather(1, best)
        new_lengths = torch.full((rows, self.keep), self.steps + 1, dtype=torch.int64)
        self.lengths = torch.cat((self.lengths, new_lengths), dim=1).gather(1, best)
        self.finished = torch.cat((self.finished, just_finished), dim=1).gather(1, best)

        self.steps += 1
        self.improvable &= self._can_improve()
        full = self.finished.all(dim=1) & torch.tensor([p.early_stopping is True for p in self.params])
        return parents, ~self.improvable | full | stops.all(dim=1)

    def hypotheses(self, row: int) -> list[tuple[list[int], float]]:
        """A request's best num_return_sequences finished hypotheses: generated tokens and score, best first."""
        start = int(self.prompt_len[row])
        return [(self.sequences[row, i, start:start + int(self.lengths[row, i])].tolist(), float(self.scores[row, i]))
                for i in range(self.params[row].num_return_sequences)]

    def keep_rows(self, rows: list[int]) -> None:
        """Only these requests search on (the others ended and left)."""
        index = torch.tensor(rows, dtype=torch.int64)
        self.params = [self.params[r] for r in rows]
        for name in ("prompt_len", "max_length", "running", "running_scores", "sequences", "lengths", "scores",
                     "finished", "improvable"):
            setattr(self, name, getattr(self, name)[index])

    def banned_tokens(self) -> list[list[list[int]]]:
        """[requests][beams] the ids transformers' NoRepeatNGramLogitsProcessor and MinNewTokensLengthLogitsProcessor
        set to -inf in each running beam's next log-probabilities."""
        eos, k = self.eos.tolist(), self.num_beams
        out = []
        for row, (p, cur) in enumerate(zip(self.params, self.cur_len.tolist())):
            short, n = self.steps < p.min_new_tokens, p.no_repeat_ngram_size
            if n > 0 and cur >= n:
                tokens = self.running[row, :, :cur]
                windows = tokens.unfold(dimension=1, size=n, step=1)       # [beams, windows, n]
                matches = (windows[..., :-1] == tokens[:, None, cur + 1 - n:]).all(dim=-1)
                # each id once: a repeated n-gram bans the same continuation once per window it matches
                out.append([sorted(set(windows[b, :, -1][matches[b]].tolist() + (eos if short else [])))
                            for b in range(k)])
            else:
                out.append([eos[:] if short else [] for _ in range(k)])
        return out

    def _greedy_step(self, log_probs: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """num_beams=1 is greedy search, as in transformers' generate: the best token after the processors, until
        EOS or max_new_tokens. Its score is its tokens' summed log-probability over length ** length_penalty.
        log_probs, tokens [requests, 1]: each request's best candidate."""
        self.running_scores += log_probs
        self.running.scatter_(2, self.cur_len[:, None, None], tokens[:, :, None])
        self.steps += 1
        done = torch.isin(tokens[:, 0], self.eos) | (self.cur_len >= self.max_length)
        self.sequences, self.lengths = self.running.clone(), torch.full_like(self.lengths, self.steps)
        self.scores = self._penalized(self.running_scores, [self.steps] * len(self.params))
        return torch.zeros_like(tokens), done

    def _penalized(self, values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """values [requests, n] / length ** length_penalty, as transformers divides (a float32 tensor by a double
        scalar, which torch rounds to float32 first): each row's divisor a Python float, then float32."""
        divisors = torch.tensor([length ** p.length_penalty for length, p in zip(lengths, self.params)],
                                dtype=torch.float64).to(values.dtype)
        return values / divisors[:, None]

    def _can_improve(self) -> torch.Tensor:
        """transformers' early-stop heuristic, per request: could the best running beam still beat the worst
        finished one?"""
        best_lengths = [int(max_len - prompt) if p.early_stopping == "never" and p.length_penalty > 0.0 else self.steps
                        for p, max_len, prompt in zip(self.params, self.max_length, self.prompt_len)]
        best_running = self._penalized(self.running_scores[:, :1], best_lengths)
        worst_finished = torch.where(self.finished, torch.min(self.scores, dim=1, keepdim=True)[0], NEG)
        return torch.any(best_running > worst_finished, dim=-1)
