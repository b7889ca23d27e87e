"""The prefix cache: full blocks of committed tokens, found again by a hash chain over their tokens, kept after
their last holder leaves until the pool needs them.

Block i of a sequence is named by h_i = H(h_{i-1}, its block_size tokens), h_-1 = H(model, salt): equal names mean
equal tokens from position 0 on, and so equal K/V in every paged layer. A block is registered once the step that
filled it is done (it can no longer be undone), so a registered block is never written again: a sequence writes
only past its own tokens, and a cached block is always full. Blocks no sequence holds stay cached, counted as
free, and are evicted least recently freed first: a sequence frees its blocks last to first, so a prefix loses its
leaves before its root."""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from metrale.runtime.cache.blocks import BlockPool
from metrale.runtime.errors import OutOfKvBlocks


def chain_root(model: str, salt: str = "") -> bytes:
    """h_-1: the name every chain of this model and salt starts from."""
    return hashlib.blake2b(f"{model}\0{salt}".encode(), digest_size=16).digest()


def chain(parent: bytes, tokens) -> bytes:
    """The name of a block holding `tokens` after the blocks `parent` names."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def block_names(parent: bytes, tokens, block_size: int, start: int = 0) -> list[bytes]:
    """The names of the full blocks of `tokens` from block `start` on; parent: the name of block start - 1 (the
    chain's root for block 0)."""
    names, name = [], parent
    for i in range(start, len(tokens) // block_size):
        name = chain(name, tokens[i * block_size:(i + 1) * block_size])
        names.append(name)
    return names


@dataclass
class PrefixCounts:
    # Blocks found for new sequences' prompts, blocks looked for and not found, cached blocks evicted.
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class CachingBlockPool(BlockPool):
    """A BlockPool whose registered blocks outlive their holders: free() keeps them (cached), allocate() evicts
    them once the free list is empty, and num_free counts them."""

    def __init__(self, num_blocks: int, kv_block_size: int):
        super().__init__(num_blocks, kv_block_size)
        self._name_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # Registered blocks no sequence holds, least recently freed first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.counts = PrefixCounts()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks only the cache holds (counted as free)."""
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free:
            raise OutOfKvBlocks(num_blocks, self.num_free)
        from_free = min(num_blocks, len(self._free))
        taken = super().allocate(from_free)
        for _ in range(num_blocks - from_free):
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._name_of.pop(block)]
            self.counts.evictions += 1
            taken.append(block)
        return taken

    def _release(self, block: int) -> None:
        """A block no one holds any more: cached where it is registered (the newest of the cached), else free."""
        if block in self._name_of:
            self._cached[block] = None
        else:
            self._free.append(block)

    def register(self, block: int, name: bytes) -> None:
        """Names a full block whose step is done; a name another block already has keeps that block."""
        if name not in self._block_of and block not in self._name_of:
            self._block_of[name], self._name_of[block] = block, name

    def match(self, names: list[bytes]) -> list[int]:
        """The blocks of the longest cached run of `names` from the first: changes nothing."""
        found = []
        for name in names:
            block = self._block_of.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def only_cached(self, blocks) -> int:
        """How many of `blocks` only the cache holds: taking them draws from the free count."""
        return sum(block in self._cached for block in blocks)

    def attach(self, match: "Match") -> None:
        """Takes a holder on each of the match's blocks (one only the cache held leaves the free count), and counts
        the match's hits and misses."""
        self.counts.hits += len(match.blocks)
        self.counts.misses += match.looked - len(match.blocks)
        for block in match.blocks:
            if block in self._cached:
                del self._cached[block]
            else:
                self.share([block])


@dataclass(frozen=True)
class Match:
    """What the cache holds of a new sequence's prompt: its chain's root, and the leading full blocks found, with
    their names and the tokens they hold."""
    root: bytes
    blocks: list[int]
    names: list[bytes]
    tokens: int
    # Full blocks of the prompt looked for (hits and misses).
    looked: int = 0


def match_prompt(pool: CachingBlockPool, root: bytes, tokens, block_size: int) -> Match:
    """The prompt's leading blocks the cache holds; its last token is always left to compute (its logits are
    the forward's answer), so at most (len(tokens) - 1) // block_size blocks. Changes nothing."""
    names = block_names(root, tokens[:(len(tokens) - 1) // block_size * block_size], block_size)
    blocks = pool.match(names)
    return Match(root, blocks, names[:len(blocks)], len(blocks) * block_size, len(names))


def cached_of(matches: dict[int, Match], pool: BlockPool) -> dict[int, tuple[int, int]]:
    """plan_step's `cached`: each match's tokens, and how many of its blocks only the cache holds now (a block two
    matches share counted once)."""
    seen, cached = set(), {}
    for seq_id, match in matches.items():
        fresh = [block for block in match.blocks if block not in seen]
        seen.update(fresh)
        cached[seq_id] = (match.tokens, pool.only_cached(fresh))
    return cached
