"""The slots of the recurrent layers' states: which are free, handed out and taken back by index."""

from metrale.runtime.errors import OutOfStateSlots


class StatePool:
    """Slots 0 .. num_slots - 1; a slot has one holder at a time."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))[::-1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfStateSlots(count, len(self._free))
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))
