"""The paged KV block pool: which blocks are free, handed out and taken back by id."""

from metrale.runtime.errors import OutOfKvBlocks


def blocks_for(num_tokens: int, kv_block_size: int) -> int:
    return -(-num_tokens // kv_block_size)


class KvBlockManager:
    def __init__(self, num_blocks: int, kv_block_size: int):
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        # Popped from the end: recently freed blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))

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

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
