"""A sequence's sampling parameters and output options, each checking its own ranges."""

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from metrale.runtime import errors

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_ABS_PENALTY = 2.0
# Ranges that keep the sampler's float32 arithmetic finite for any logits a model gives: a logit is scaled by at most
# 1 / MIN_TEMPERATURE and by at most MAX_REPETITION_PENALTY, and moved by at most MAX_ABS_LOGIT_BIAS.
# The lower bounds are 0.01 as float32 (0.0099999998): the API's float fields are float32.
MIN_TEMPERATURE, MAX_TEMPERATURE = float(np.float32(0.01)), 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = float(np.float32(0.01)), 100.0
MAX_ABS_LOGIT_BIAS = 100.0


def random_seed() -> int:
    """A fresh uint64 seed for a sequence that did not bring one."""
    return int.from_bytes(os.urandom(8), "little")


def _check_real(name: str, value, in_range: Callable[[float], bool], allowed: str) -> None:
    finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not (finite and in_range(value)):
        raise errors.InvalidArgument(f"{name}={value!r} is out of range: {allowed}")


def _check_int(name: str, value, in_range: Callable[[int], bool], allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not in_range(value):
        raise errors.InvalidArgument(f"{name}={value!r} is out of range: {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off; larger than the vocabulary = off
    top_p: float = 1.0  # 1 = off, in (0, 1]
    min_p: float = 0.0  # 0 = off, in [0, 1]
    seed: int | None = None  # uint64; None = the engine picks one at sequence creation
    repetition_penalty: float = 1.0  # > 0; HF semantics over prompt + generated tokens
    presence_penalty: float = 0.0  # [-2, 2], over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], over generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token_id, bias); repeated ids add up

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True where the logits must be changed before the token choice."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    def validate(self, vocab_size: int) -> None:
        _check_real("sampling.temperature", self.temperature,
                    lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
                    f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        _check_int("sampling.top_k", self.top_k, lambda v: v >= 0,
                   "must be an integer >= 0 (0, or the vocabulary's size and up = off)")
        _check_real("sampling.top_p", self.top_p, lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)")
        _check_real("sampling.min_p", self.min_p, lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)")
        if self.seed is not None:
            _check_int("sampling.seed", self.seed, lambda v: 0 <= v <= MAX_SEED,
                       f"must be a uint64, in [0, {MAX_SEED}]")
        _check_real("sampling.repetition_penalty", self.repetition_penalty,
                    lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                    f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        for field in ("presence_penalty", "frequency_penalty"):
            _check_real(f"sampling.{field}", getattr(self, field), lambda v: abs(v) <= MAX_ABS_PENALTY,
                        f"must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}] (0 = off)")
        if len(self.logit_bias) > vocab_size:
            raise errors.InvalidArgument(f"sampling.logit_bias has {len(self.logit_bias)} entries: it must have at "
                                         f"most one per vocabulary id ({vocab_size})")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise errors.InvalidArgument(f"sampling.logit_bias entry {pair!r} is malformed: "
                                             f"must be a (token_id, bias) pair")
            token_id, bias = pair
            _check_int("sampling.logit_bias token id", token_id, lambda v: 0 <= v < vocab_size,
                       f"must be in [0, {vocab_size}) (the vocabulary size)")
            _check_real(f"sampling.logit_bias[{token_id}]", bias, lambda v: abs(v) <= MAX_ABS_LOGIT_BIAS,
                        f"the bias must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")


@dataclass(frozen=True)
class OutputOptions:
    logprobs: bool = False
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS
    return_logits: bool = False

    def validate(self) -> None:
        _check_int("output.top_logprobs", self.top_logprobs, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                   f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
