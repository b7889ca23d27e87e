"""The block pool of the paged layers (K/V, latent): which blocks are free, handed out and taken back by id, and
shared by reference. A block holds kv_block_size tokens of every paged layer."""

import numpy as np

from metrale.runtime.errors import OutOfKvBlocks


def blocks_for(num_tokens: int, kv_block_size: int) -> int:
    return -(-num_tokens // kv_block_size)


def tail_split(num_tokens: int, kv_block_size: int) -> int | None:
    """The last block boundary strictly inside a prompt of num_tokens (None where there is none): where a chunk
    ends so that a recurrent state's snapshot lands on a block before the prompt's tail."""
    return (num_tokens - 1) // kv_block_size * kv_block_size or None


class BlockPool:
    """Blocks 0 .. num_blocks - 1 (or the given ids: a reservation taken out of another pool, as a
    BeamGenerate call's). A block handed out has one holder; share() adds holders (beams that continue the same
    prefix), and free() gives a block back once its last holder frees it."""

    def __init__(self, num_blocks: int, kv_block_size: int, ids: list[int] | None = None):
        self.ids = list(range(num_blocks)) if ids is None else list(ids)
        self.num_blocks = len(self.ids)
        self.kv_block_size = kv_block_size
        # Popped from the end: recently freed blocks are reused first.
        self._free = self.ids[::-1]
        # Holders beyond the first, of the blocks that have any.
        self._shares: dict[int, int] = {}
        self._order = self._sorted = None          # indices(): ids sorted, and where each sorted one is in ids

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise OutOfKvBlocks(num_blocks, len(self._free))
        taken = self._free[len(self._free) - num_blocks:]
        del self._free[len(self._free) - num_blocks:]
        return taken[::-1]

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self._shares[block] = self._shares.get(block, 0) + 1

    def is_shared(self, block: int) -> bool:
        return block in self._shares

    def indices(self, blocks) -> np.ndarray:
        """Each of `blocks` (ids of this pool) as its index in ids, int32."""
        if self._order is None:
            ids = np.asarray(self.ids, dtype=np.int64)
            self._order = np.argsort(ids, kind="stable")
            self._sorted = ids[self._order]
        wanted = np.asarray(blocks, dtype=np.int64)
        found = np.minimum(np.searchsorted(self._sorted, wanted), max(len(self.ids) - 1, 0))
        if len(wanted) and not np.array_equal(self._sorted[found], wanted):
            raise ValueError("a block that is not this pool's")
        return self._order[found].astype(np.int32)

    def holders(self) -> tuple[np.ndarray, np.ndarray]:
        """The free blocks as indices in ids (allocate() takes from the end first), and each block's holders in the
        order of ids (0: free), int32."""
        free = self.indices(self._free)
        held = np.ones(len(self.ids), dtype=np.int32)
        held[free] = 0
        if self._shares:
            held[self.indices(list(self._shares))] += np.fromiter(self._shares.values(), dtype=np.int32,
                                                                  count=len(self._shares))
        return free, held

    def free(self, blocks: list[int]) -> None:
        """Drops one holder of each block, last block first; a block whose last holder leaves is released."""
        for block in reversed(blocks):
            shares = self._shares.get(block)
            if shares is None:
                self._release(block)
            elif shares == 1:
                del self._shares[block]
            else:
                self._shares[block] = shares - 1

    def _release(self, block: int) -> None:
        """A block no one holds any more: free."""
        self._free.append(block)
