"""The paged KV block pool: which blocks are free, handed out and taken back by id, and shared by reference."""

from metrale.runtime.errors import OutOfKvBlocks


def blocks_for(num_tokens: int, kv_block_size: int) -> int:
    return -(-num_tokens // kv_block_size)


class KvBlockManager:
    """Blocks 0 .. num_blocks - 1 (or the given ids: a reservation taken out of another manager, as a
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

    def holders(self) -> tuple[list[int], dict[int, int]]:
        """The free blocks (allocate() takes from the end first) and each handed-out block's holders."""
        free = set(self._free)
        return list(self._free), {b: 1 + self._shares.get(b, 0) for b in self.ids if b not in free}

    def free(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            shares = self._shares.get(block)
            if shares is None:
                self._free.append(block)
            elif shares == 1:
                del self._shares[block]
            else:
                self._shares[block] = shares - 1
