"""Admission of forward work (the step RPCs, BeamGenerate, Generate): refused while the worker drains, or past
--max-concurrent-rpcs calls in flight. Control calls (health, Info, Release, ...) never pass through here, so they
get through under any load."""

import asyncio
import contextlib

from metrale.runtime.errors import Draining, Overloaded


class ServingState:
    """Draining flag and in-flight count of forward calls, shared by the servicer and the shutdown path."""

    def __init__(self, max_in_flight: int | None = None):
        self.max_in_flight = max_in_flight      # None: no limit
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @contextlib.contextmanager
    def admitted(self):
        """Counts a forward call as in flight; refuses it once the worker drains, or where the limit is reached."""
        if self.draining:
            raise Draining()
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise Overloaded(self.in_flight, self.max_in_flight)
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
