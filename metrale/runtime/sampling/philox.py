"""Philox4x32-10 (Random123) and the one uniform per (seed, position) that the sampler draws.

The CUDA sampler kernel implements the same function; both must agree bit for bit:
    key     = (seed & 0xFFFFFFFF, seed >> 32)               # seed: uint64
    counter = (position & 0xFFFFFFFF, position >> 32, 0, 0)  # position: uint64
    x       = philox4x32_10(counter, key)[0]
    u       = ((x >> 8) + 0.5) / 2**24                        # in float64: exact, strictly inside (0, 1)
u needs 25 significant bits, so it is not exact in float32: compute and compare it in double.
"""

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Random123's philox4x32_R(10, counter, key): four uint32 words in, four out."""
    c0, c1, c2, c3 = (word & _MASK32 for word in counter)
    k0, k1 = (word & _MASK32 for word in key)
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            # key schedule: the Weyl increments are added between rounds, not before the first
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        product0 = PHILOX_M0 * c0
        product1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = (
            (product1 >> 32) ^ c1 ^ k0,
            product1 & _MASK32,
            (product0 >> 32) ^ c3 ^ k1,
            product0 & _MASK32,
        )
    return c0, c1, c2, c3


def uniform(seed: int, position: int) -> float:
    """The sampler's u in (0, 1) for a sequence's seed and the position of the token being sampled."""
    seed &= _MASK64
    position &= _MASK64
    x = philox4x32_10((position & _MASK32, position >> 32, 0, 0), (seed & _MASK32, seed >> 32))[0]
    return ((x >> 8) + 0.5) / 2**24
