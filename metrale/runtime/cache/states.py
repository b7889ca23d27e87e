"""The slots of the recurrent layers' states: which are free, handed out and taken back by index; and the
snapshots the prefix cache keeps in some of them.

A snapshot is the state of a prompt's sequence after a full block, kept under that block's prefix-cache name (as
the block's K/V are), so that a new sequence whose prompt starts with the same blocks resumes from it. Snapshots
are evictable, least recently used first, and at most max_snapshots are kept. A sequence that resumes from one
pins it until its first step is done (its forward reads the slot); free() never frees a snapshot's slot."""

from collections import OrderedDict

from metrale.runtime.errors import OutOfStateSlots


class StatePool:
    """Slots 0 .. num_slots - 1; a slot has one holder at a time (a sequence, or the snapshots)."""

    def __init__(self, num_slots: int, max_snapshots: int = 0):
        self.num_slots, self.max_snapshots = num_slots, max_snapshots
        self._free = list(range(num_slots))[::-1]
        self._slot_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        # Unpinned snapshots, least recently used first: evicted when the free slots run out.
        self._unpinned: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._pending = 0           # slots taken for snapshots to come (take_snapshot_slot)

    @property
    def num_free(self) -> int:
        """Free slots, and snapshots no sequence is resuming from (allocate evicts them)."""
        return len(self._free) + len(self._unpinned)

    @property
    def num_unused(self) -> int:
        """Free slots alone (no snapshot evicted for them)."""
        return len(self._free)

    @property
    def num_snapshots(self) -> int:
        return len(self._slot_of)

    def take_snapshot_slot(self) -> int:
        """A slot for a snapshot to come (a step's, kept or freed when it is done), or -1 where none may be taken:
        snapshots kept and to come stay within max_snapshots, the least recently used kept one making room, and
        no other snapshot is evicted for it."""
        if self.max_snapshots == 0:
            return -1
        if len(self._slot_of) + self._pending >= self.max_snapshots and self._unpinned:
            self._evict()
        if len(self._slot_of) + self._pending >= self.max_snapshots or not self._free:
            return -1
        self._pending += 1
        return self._free.pop()

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfStateSlots(count, self.num_free)
        while len(self._free) < count:
            self._evict()
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        """Gives slots back; a snapshot's slot stays the snapshots' (unpin releases a sequence's hold on it)."""
        self._free.extend(slot for slot in reversed(slots) if slot not in self._name_of)

    def keep_snapshot(self, name: bytes, slot: int) -> None:
        """Makes a slot take_snapshot_slot gave, now holding the state after the block `name`, a snapshot; where
        that block has one already the slot is freed. The least recently used beyond max_snapshots go."""
        self._pending -= 1
        if name in self._slot_of:
            self.free([slot])
            return
        self._slot_of[name], self._name_of[slot] = slot, name
        self._unpinned[slot] = None
        while len(self._slot_of) > self.max_snapshots and self._unpinned:
            self._evict()

    def drop_snapshot_slot(self, slot: int) -> None:
        """Gives back a slot take_snapshot_slot gave, unused (its step undone, or its block unnamed)."""
        self._pending -= 1
        self.free([slot])

    def snapshot(self, name: bytes) -> int | None:
        """The slot of the snapshot after the block `name`, if one is kept; changes nothing."""
        return self._slot_of.get(name)

    def pin(self, slot: int) -> None:
        """A sequence resumes from this snapshot: it is not evicted until unpinned."""
        self._unpinned.pop(slot, None)
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins.pop(slot) - 1
        if left:
            self._pins[slot] = left
        else:
            self._unpinned[slot] = None         # the most recently used

    def _evict(self) -> None:
        slot, _ = self._unpinned.popitem(last=False)
        del self._slot_of[self._name_of.pop(slot)]
        self._free.append(slot)
