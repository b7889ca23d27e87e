"""Device lanes: one thread per stream runs that stream's work in order. Handlers only submit.

A sequence belongs to at most one submitted piece of work at a time; a second claim is refused.
"""

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from metrale.runtime.errors import InvalidArgument, SequenceBusy


class DeviceLanes:
    def __init__(self, num_lanes: int):
        self._queues = [queue.SimpleQueue() for _ in range(num_lanes)]
        self._claimed: set[int] = set()
        self._claim_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(q,), name=f"device-lane-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    @property
    def num_lanes(self) -> int:
        return len(self._queues)

    def submit(self, lane: int, seq_ids: list[int], work: Callable[[], object]) -> Future:
        """Runs work() on the lane's thread; the future's result is (work's result, queue_us)."""
        self.check_lane(lane)
        claim = set(seq_ids)
        with self._claim_lock:
            busy = claim & self._claimed
            if busy:
                raise SequenceBusy(busy)
            self._claimed |= claim
        future: Future = Future()
        self._queues[lane].put((future, work, claim, time.perf_counter()))
        return future

    def check_lane(self, lane: int) -> None:
        if not 0 <= lane < len(self._queues):
            raise InvalidArgument(f"stream {lane} does not exist; the worker has {len(self._queues)} streams")

    def submit_in_order(self, lane: int, work: Callable[[], object]) -> Future:
        """Runs work after everything already queued on the lane, claiming nothing: for clean-up of sequences
        only this lane's queued work can touch (a cancelled Generate's)."""
        self.check_lane(lane)
        future: Future = Future()
        self._queues[lane].put((future, work, set(), time.perf_counter()))
        return future

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()

    def _serve(self, work_queue: queue.SimpleQueue) -> None:
        while (item := work_queue.get()) is not None:
            future, work, claim, enqueued = item
            result = error = None
            running = future.set_running_or_notify_cancel()
            if running:
                queue_us = int((time.perf_counter() - enqueued) * 1e6)
                try:
                    result = (work(), queue_us)
                except BaseException as caught:  # handed to the waiting handler
                    error = caught
            # Unclaim before the handler sees the result, so its next step on these sequences is accepted.
            with self._claim_lock:
                self._claimed -= claim
            if running and error is not None:
                future.set_exception(error)
            elif running:
                future.set_result(result)
