"""One request's beam search, step for step as transformers' `GenerationMixin._beam_search` (5.x) runs it for one
item of its batch, so the hypotheses and their scores are the ones `generate(num_beams=...)` returns.

Per step, from the running beams' logits: log-softmax, the logits processors (no_repeat_ngram_size,
min_new_tokens), add each beam's running score, keep the best max(2, 1 + #eos) x num_beams continuations
over all beams; the best num_beams of those that did not stop (EOS or max_length) run on, and those that did
stop among the first num_beams compete with the finished hypotheses, scored with the length penalty. The search
ends when no running beam can improve on the finished ones (transformers' heuristic, which depends on
early_stopping), when early_stopping is TRUE and num_beams hypotheses are finished, or when every continuation
stopped. A request that ends leaves the batch; its hypotheses no longer change in transformers either.

The arithmetic (float32 tensors, the -1e9 offsets, the order of the additions) follows transformers so that
equal logits give equal scores, bit for bit.
"""

import math

import torch

from metrale.runtime.beam.params import BeamParams

NEG = -1.0e9


class BeamSearch:
    def __init__(self, params: BeamParams, prompt: list[int], eos_token_ids: tuple[int, ...], fill_token: int):
        """prompt: the tokens before the first generated one (a decoder-only prompt, or an encoder-decoder's
        decoder start and prefix); generation ends by max_new_tokens past it."""
        k = params.num_beams
        self.params = params
        self.prompt_len = len(prompt)
        self.max_length = self.prompt_len + params.max_new_tokens
        self.cur_len = self.prompt_len
        self.eos = torch.tensor(eos_token_ids, dtype=torch.int64)
        self.keep = max(2, 1 + len(eos_token_ids)) * k
        self.top_mask = torch.arange(self.keep) < k
        self.running = torch.full((k, self.max_length), fill_token, dtype=torch.int64)
        self.running[:, :self.prompt_len] = torch.tensor(prompt, dtype=torch.int64)
        self.running_scores = torch.zeros(k)
        self.running_scores[1:] = NEG
        # The finished hypotheses: num_beams slots, -1e9 while empty.
        self.sequences = self.running.clone()
        self.lengths = torch.zeros(k, dtype=torch.int64)
        self.scores = torch.full((k,), NEG)
        self.finished = torch.zeros(k, dtype=torch.bool)
        self.improvable = True
        self.done = False

    @property
    def num_beams(self) -> int:
        return self.params.num_beams

    def tokens(self) -> torch.Tensor:
        """Every running beam's tokens so far, [num_beams, cur_len]."""
        return self.running[:, :self.cur_len]

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_beams, vocab] of the running beams' last tokens. Returns, for each new running beam, the
        index of the beam it continues; its new token is tokens()[:, -1]. Sets `done` when the search ends."""
        if self.num_beams == 1:
            return self._greedy_step(logits)
        p, k = self.params, self.num_beams
        log_probs = self._process(torch.log_softmax(logits.float(), dim=-1))
        vocab = log_probs.shape[-1]
        log_probs = (log_probs + self.running_scores[:, None]).reshape(1, -1)
        top_log_probs, top_indices = (t[0] for t in torch.topk(log_probs, k=self.keep))
        top_beams, top_ids = top_indices // vocab, top_indices % vocab
        top_sequences = self.running[top_beams]
        top_sequences[:, self.cur_len] = top_ids
        stops = torch.isin(top_ids, self.eos) | (self.cur_len + 1 >= self.max_length)

        # The next running beams: the best that did not stop.
        running_log_probs = top_log_probs + stops.to(torch.float32) * NEG
        chosen = _topk(running_log_probs, k)
        self.running, self.running_scores = top_sequences[chosen], running_log_probs[chosen]
        parents = top_beams[chosen]

        # Finished hypotheses: those of the first num_beams continuations that stopped, if they beat a kept one.
        just_finished = stops & self.top_mask
        # (transformers also pushes every candidate down by -1e9 once its item can no longer improve or, with
        # early_stopping TRUE, is full: that keeps a finished item frozen while others run. Here the search is done
        # at that point and leaves.)
        candidates = top_log_probs / ((self.cur_len + 1 - self.prompt_len) ** p.length_penalty)
        candidates += (~just_finished) * NEG
        scores = torch.cat((self.scores, candidates))
        best = _topk(scores, k)
        self.sequences = torch.cat((self.sequences, top_sequences))[best]
        self.scores = scores[best]
        new_lengths = torch.full((self.keep,), self.cur_len + 1 - self.prompt_len, dtype=torch.int64)
        self.lengths = torch.cat((self.lengths, new_lengths))[best]
        self.finished = torch.cat((self.finished, just_finished))[best]

        self.cur_len += 1
        self.improvable = self.improvable and self._can_improve()
        self.done = not self.improvable or (bool(self.finished.all()) and p.early_stopping is True) \
            or bool(stops.all())
        return parents

    def _greedy_step(self, logits: torch.Tensor) -> torch.Tensor:
        """num_beams=1 is greedy search, as in transformers' generate: the best token after the processors, until
        EOS or max_new_tokens. Its score is its tokens' summed log-probability over length ** length_penalty."""
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        token = int(torch.argmax(self._process(log_probs)[0]))
        self.running_scores[0] += log_probs[0, token]
        self.running[0, self.cur_len] = token
        self.cur_len += 1
        self.done = token in self.eos.tolist() or self.cur_len >= self.max_length
        if self.done:
            length = self.cur_len - self.prompt_len
            self.sequences, self.lengths = self.running.clone(), torch.tensor([length])
            self.scores = self.running_scores / (length ** self.params.length_penalty)
        return torch.zeros(1, dtype=torch.int64)

    def hypotheses(self) -> list[tuple[list[int], float]]:
        """The best num_return_sequences finished hypotheses: generated tokens and score, best first."""
        out = []
        for i in range(self.params.num_return_sequences):
            n = int(self.lengths[i])
            out.append((self.sequences[i, self.prompt_len:self.prompt_len + n].tolist(), float(self.scores[i])))
        return out

    def _process(self, log_probs: torch.Tensor) -> torch.Tensor:
        """transformers' NoRepeatNGramLogitsProcessor and MinNewTokensLengthLogitsProcessor, in that order."""
        p, tokens = self.params, self.tokens()
        n = p.no_repeat_ngram_size
        if n > 0 and self.cur_len >= n:
            prefix = tokens[:, self.cur_len + 1 - n:]
            windows = tokens.unfold(dimension=1, size=n, step=1)
            matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1)
            vocab = log_probs.shape[-1]
            banned = log_probs.new_zeros((log_probs.shape[0], vocab + 1), dtype=torch.bool)
            banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
            log_probs = log_probs.masked_fill(banned[:, :vocab], -math.inf)
        if self.cur_len - self.prompt_len < p.min_new_tokens and self.eos.numel():
            is_eos = torch.isin(torch.arange(log_probs.shape[-1]), self.eos)
            log_probs = torch.where(is_eos, -math.inf, log_probs)
        return log_probs

    def _can_improve(self) -> bool:
        """transformers' early-stop heuristic: could the best running beam still beat the worst finished one?"""
        p = self.params
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = self.cur_len - self.prompt_len
        best_running = self.running_scores[:1] / (best_length ** p.length_penalty)
        worst_finished = torch.where(self.finished, torch.min(self.scores), NEG)
        return bool(torch.any(best_running > worst_finished))


def _topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest, taken over a [1, n] row as transformers does (ties resolve the same way)."""
    return torch.topk(values[None], k=k)[1][0]
