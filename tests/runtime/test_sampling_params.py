"""SamplingParams.validate and OutputOptions.validate: every range edge accepted, everything past it rejected."""

import math

import pytest

from metrale.runtime import errors
from metrale.runtime.sampling import MAX_TOP_LOGPROBS, OutputOptions, SamplingParams, random_seed

VOCAB_SIZE = 1000

ACCEPTED = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.01},
    {"temperature": 100.0},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": VOCAB_SIZE * 10},  # larger than the vocabulary: everything stays
    {"top_k": 2**32 - 1},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"seed": 0},
    {"seed": 2**64 - 1},
    {"repetition_penalty": 0.01},
    {"repetition_penalty": 100.0},
    {"presence_penalty": -2.0},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0},
    {"frequency_penalty": 2.0},
    {"logit_bias": ((0, -100.0), (VOCAB_SIZE - 1, 100.0))},
    {"logit_bias": ((5, 1.0), (5, 2.0))},  # a repeated id: the biases add up
]

REJECTED = [
    ("temperature", -1e-6), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("temperature", 1e-45), ("temperature", 0.0099), ("temperature", 100.01), ("temperature", 1e37),
    ("top_k", -1), ("top_k", 2.5), ("top_k", None),
    ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.0000001), ("top_p", math.nan),
    ("min_p", -1e-9), ("min_p", 1.01), ("min_p", math.nan),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", 1e-45), ("repetition_penalty", 0.0099), ("repetition_penalty", 100.01),
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("frequency_penalty", 2.01), ("frequency_penalty", -2.01), ("frequency_penalty", -math.inf),
    ("logit_bias", ((VOCAB_SIZE, 1.0),)), ("logit_bias", ((-1, 1.0),)), ("logit_bias", ((3, math.nan),)),
    ("logit_bias", ((3, math.inf),)), ("logit_bias", ((3,),)), ("logit_bias", ((2.0, 1.0),)),
    ("logit_bias", ((3, 100.01),)), ("logit_bias", ((3, -3e38),)),
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=repr)
def test_validate_accepts_the_edges(fields):
    SamplingParams(**fields).validate(VOCAB_SIZE)


@pytest.mark.parametrize("field, value", REJECTED, ids=repr)
def test_validate_rejects_values_out_of_range_naming_field_and_value(field, value):
    with pytest.raises(errors.InvalidArgument) as raised:
        SamplingParams(**{field: value}).validate(VOCAB_SIZE)
    message = str(raised.value)
    assert f"sampling.{field}" in message
    assert "must" in message  # says what is allowed
    if field != "logit_bias":
        assert repr(value) in message


def test_validate_rejects_more_biases_than_the_vocabulary_has_ids():
    with pytest.raises(errors.InvalidArgument, match="logit_bias has 1001 entries"):
        SamplingParams(logit_bias=tuple((i % VOCAB_SIZE, 0.0) for i in range(VOCAB_SIZE + 1))).validate(VOCAB_SIZE)


def test_greedy_is_temperature_zero():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_penalties_are_off_by_default():
    assert not SamplingParams(temperature=1.0, top_k=5, top_p=0.5, min_p=0.1).has_penalties
    for fields in ({"repetition_penalty": 1.1}, {"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
                   {"logit_bias": ((1, 0.5),)}):
        assert SamplingParams(**fields).has_penalties


@pytest.mark.parametrize("top_logprobs", [0, 1, MAX_TOP_LOGPROBS])
def test_output_options_accept_top_logprobs_in_range(top_logprobs):
    OutputOptions(logprobs=True, top_logprobs=top_logprobs, return_logits=True).validate()


@pytest.mark.parametrize("top_logprobs", [-1, MAX_TOP_LOGPROBS + 1, 2.0])
def test_output_options_reject_top_logprobs_out_of_range(top_logprobs):
    with pytest.raises(errors.InvalidArgument, match="output.top_logprobs"):
        OutputOptions(top_logprobs=top_logprobs).validate()


def test_random_seed_is_a_fresh_uint64():
    seeds = {random_seed() for _ in range(64)}
    assert len(seeds) == 64
    assert all(0 <= seed < 2**64 for seed in seeds)
    SamplingParams(seed=random_seed()).validate(VOCAB_SIZE)
