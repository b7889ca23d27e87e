"""Philox4x32-10 against Random123's published known-answer vectors, and the sampler's uniform."""

import pytest

from metrale.runtime.sampling import philox4x32_10, uniform

# Random123 kat_vectors: "philox4x32 10 <counter x4> <key x2> <output x4>"
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(counter, key, expected):
    assert philox4x32_10(counter, key) == expected


def test_uniform_takes_key_from_seed_and_counter_from_position():
    seed, position = 0x299F31D0A4093822, 0x85A308D3243F6A88
    x = philox4x32_10((position & 0xFFFFFFFF, position >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))[0]
    assert uniform(seed, position) == ((x >> 8) + 0.5) / 2**24
    # counter = (0, 0, 0, 0), key = (0, 0): the first word of the first known answer
    assert uniform(0, 0) == ((0x6627E8D5 >> 8) + 0.5) / 2**24


def test_uniform_is_strictly_inside_the_unit_interval_and_spread():
    draws = [uniform(12345, position) for position in range(20000)]
    assert all(0.0 < u < 1.0 for u in draws)
    assert len(set(draws)) > 19900  # 2**24 values: a few collisions at most
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    # each tenth of (0, 1) gets its share
    for decile in range(10):
        share = sum(decile / 10 <= u < (decile + 1) / 10 for u in draws) / len(draws)
        assert abs(share - 0.1) < 0.01


def test_uniform_depends_on_every_word_of_seed_and_position():
    base = uniform(7, 9)
    assert uniform(7 + 2**32, 9) != base  # seed high word
    assert uniform(8, 9) != base  # seed low word
    assert uniform(7, 9 + 2**32) != base  # position high word
    assert uniform(7, 10) != base  # position low word
    assert uniform(7, 9) == base  # and nothing else
