"""Per-sequence state the worker keeps between steps, and the table of live sequences."""

import time
from dataclasses import dataclass, field

import numpy as np

from metrale.runtime.sampling import OutputOptions, SamplingParams


class BlockTable:
    """A sequence's KV block ids in order, as int32 in a numpy buffer that grows by doubling: a forward copies the
    tables of its sequences as arrays, where converting ~70 Python ints per sequence at every step cost ~18 ns
    each (0.3 ms at 256 sequences)."""

    __slots__ = ("_ids", "_len")

    def __init__(self, ids=()):
        self._ids = np.zeros(max(16, len(ids)), dtype=np.int32)
        self._len = 0
        self.extend(ids)

    def __len__(self) -> int:
        return self._len

    def extend(self, ids) -> None:
        end = self._len + len(ids)
        if end > len(self._ids):
            grown = np.zeros(max(end, 2 * len(self._ids)), dtype=np.int32)
            grown[:self._len] = self._ids[:self._len]
            self._ids = grown
        self._ids[self._len:end] = ids
        self._len = end

    def truncate(self, length: int) -> list[int]:
        """Keeps the first `length` blocks; returns the ones dropped."""
        dropped = self._ids[length:self._len].tolist()
        self._len = min(self._len, length)
        return dropped

    def array(self, length: int | None = None) -> np.ndarray:
        """The first `length` (default: all) ids: a view, valid until the table changes."""
        if length is None:
            length = self._len
        elif length > self._len:
            raise IndexError(f"{length} blocks asked of a table of {self._len}")
        return self._ids[:length]

    def slot(self, position: int, block_size: int) -> int:
        """KV slot of the token at `position`."""
        index = position // block_size
        if index >= self._len:     # the buffer past the table may hold freed ids: never hand them out
            raise IndexError(f"position {position} is past the table's {self._len} blocks of {block_size}")
        return int(self._ids[index]) * block_size + position % block_size

    def tolist(self) -> list[int]:
        return self._ids[:self._len].tolist()


@dataclass
class Sequence:
    seq_id: int
    sampling: SamplingParams
    output: OutputOptions
    # Resolved sampling seed (uint64): the Philox key.
    seed: int
    # Every token whose KV is cached: the prompt so far, then each decoded token.
    tokens: list[int] = field(default_factory=list)
    prompt_finished: bool = False
    num_prompt_tokens: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    # Encoder-decoder models: the blocks holding the source's cross-attention K/V (every decoder layer), and its
    # length; written once, by the sequence's first forward.
    cross_table: BlockTable | None = None
    source_len: int = 0
    # Models with recurrent layers: the slot of the sequence's state (-1: none), and the slot its next forward
    # reads the state from: the slot before, until a step's first forward has run (-1: a new sequence's zeros).
    state_slot: int = -1
    state_source: int = -1
    # The prefix cache (cache/prefix.py): the name every chain of this sequence starts from (the model and its
    # salt), the names of its full blocks registered so far, and the prompt tokens its first slice found cached.
    cache_root: bytes = b""
    block_names: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


class SequenceTable:
    def __init__(self):
        self._sequences: dict[int, Sequence] = {}
        # When a step or Fork last used each sequence (time.monotonic): one dict update a step, in C, rather than an
        # attribute set a sequence on the decode path. A sequence idle past the worker's TTL is released.
        self._touched: dict[int, float] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def get(self, seq_id: int) -> Sequence | None:
        return self._sequences.get(seq_id)

    def add(self, sequence: Sequence) -> None:
        self._sequences[sequence.seq_id] = sequence
        self._touched[sequence.seq_id] = time.monotonic()

    def remove(self, seq_id: int) -> Sequence | None:
        self._touched.pop(seq_id, None)
        return self._sequences.pop(seq_id, None)

    def ids(self) -> list[int]:
        return list(self._sequences)

    def idle(self, seconds: float, now: float) -> list[int]:
        """The sequences not touched in the `seconds` before `now`."""
        return [seq_id for seq_id, touched in self._touched.items() if now - touched >= seconds]

    def touch(self, seq_ids: list[int], now: float) -> None:
        """Marks the live ones of seq_ids used at `now`."""
        self._touched.update(dict.fromkeys(seq_ids, now))
        if len(self._touched) > len(self._sequences):       # an id of the step released by now: not kept
            for seq_id in [i for i in self._touched if i not in self._sequences]:
                del self._touched[seq_id]
