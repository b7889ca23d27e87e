"""A step as the engine receives it: decode tokens plus prefill slices, and what it returns."""

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from metrale.runtime.errors import InvalidArgument, OutOfRange, name_ids
from metrale.runtime.sampling import OutputOptions, SamplingParams


@dataclass(frozen=True)
class PrefillSlice:
    seq_id: int
    tokens: tuple[int, ...]
    chunk_start: int = 0
    is_last_chunk: bool = True
    # > 0: the worker runs the slice as several forwards of this many tokens.
    chunk_size: int = 0
    sampling: SamplingParams = SamplingParams()
    output: OutputOptions = OutputOptions()
    # Prefix caching: blocks are shared only between prompts of the same salt (a gateway's tenant, say).
    cache_salt: str = ""


class DecodeToken(NamedTuple):
    """A tuple (made per sequence per step, from packed arrays: a tuple is the cheapest immutable record)."""
    seq_id: int
    # Appended to the sequence; its KV is computed and the next token sampled.
    token: int


@dataclass(frozen=True)
class Step:
    decode: tuple[DecodeToken, ...] = ()
    prefill: tuple[PrefillSlice, ...] = ()

    # Decode's, then prefill's: read by the checks, the stream's claims, the engine and the logs, so made once.
    seq_ids: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "seq_ids", [entry.seq_id for entry in self.decode] + [s.seq_id for s in self.prefill])

    def check(self, vocab_size: int, max_model_len: int) -> None:
        """Checks what needs no sequence state, lengths before ids; raises InvalidArgument or OutOfRange."""
        if not self.decode and not self.prefill:
            raise InvalidArgument("the step is empty: give decode tokens or prefill slices")
        for s in self.prefill:
            if s.chunk_start + len(s.tokens) > max_model_len:
                raise OutOfRange(f"seq_id {s.seq_id}: chunk_start={s.chunk_start} and {len(s.tokens)} tokens pass "
                                 f"max_model_len={max_model_len}")
        if len(set(self.seq_ids)) < len(self.seq_ids):
            seen: set[int] = set()
            duplicates = sorted({i for i in self.seq_ids if i in seen or seen.add(i)})
            raise InvalidArgument(f"seq_id(s) {name_ids(duplicates)} appear more than once in one request")
        bad = next((entry for entry in self.decode if not 0 <= entry.token < vocab_size), None)
        if bad is not None:
            check_token_ids(f"seq_id {bad.seq_id}", (bad.token,), vocab_size)
        for s in self.prefill:
            if not s.tokens:
                raise InvalidArgument(f"seq_id {s.seq_id}: a prefill slice needs at least one token")
            check_token_ids(f"seq_id {s.seq_id}", s.tokens, vocab_size)
            if s.chunk_start == 0:
                s.sampling.validate(vocab_size)
                s.output.validate()


def check_token_ids(where: str, tokens, vocab_size: int) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{where}: token id {bad} is out of range, vocab_size is {vocab_size}")


class SequenceOutput(NamedTuple):
    """A tuple, as DecodeToken (made per sequence per step, from the sampler's columns)."""
    seq_id: int
    token: int
    logprob: float
    top_logprobs: tuple[list[int], list[float]] | None = None
    # [vocab_size] float32, only where the sequence asked.
    logits: torch.Tensor | None = None
    # The prompt tokens the prefix cache served, in the output that finishes the prompt.
    cached_tokens: int = 0


@dataclass
class StepOutput:
    outputs: list[SequenceOutput] = field(default_factory=list)
    forward_us: int = 0
    # The guessed next step the engine reserved after this one (run_ahead.Ahead), for the stream to run.
    ahead: object = None
    # The answer the caller built from the outputs inside the step (Engine.step's reply), for it to send.
    reply: object = None
