"""Stream threads: one thread per stream runs that stream's work in order. Handlers only submit.

A sequence belongs to at most one submitted piece of work at a time; a second claim is refused.
"""

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import structlog

from metrale.runtime.errors import InvalidArgument, SequenceBusy

log = structlog.get_logger()


class StreamThreads:
    def __init__(self, num_streams: int, on_thread_start: Callable[[int], None] = lambda stream: None):
        """on_thread_start(stream) runs first on each stream's thread (the backend binds it to the stream's stream)."""
        self._queues = [queue.SimpleQueue() for _ in range(num_streams)]
        self._claimed: set[int] = set()
        self._claim_lock = threading.Lock()
        self._on_thread_start = on_thread_start
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"stream-{i}", daemon=True)
                         for i in range(num_streams)]
        for thread in self._threads:
            thread.start()

    @property
    def num_streams(self) -> int:
        return len(self._queues)

    def submit(self, stream: int, seq_ids: list[int], work: Callable[[], object],
               after: Callable[[object, bool, Callable[[], None]], None] | None = None) -> Future:
        """Runs work() on the stream's thread; the future's result is (work's result, queue_us). With `after`, the
        stream then calls after(result, stream_idle, hand_over) before its next work (stream_idle: nothing else is
        queued on the stream), and the result reaches the future when after calls hand_over() (or returns)."""
        self.check_stream(stream)
        claim = self._claim(seq_ids)
        future: Future = Future()
        self._queues[stream].put((future, work, claim, time.perf_counter(), after))
        return future

    def run_claimed(self, executor, seq_ids: list[int], work: Callable[[], object]) -> Future:
        """Runs work() on `executor`, off the streams, with the sequences claimed as a stream's work claims them: for
        work that needs no device and must not wait behind a stream's queue (Release). The claims drop once work is
        done, or if it never starts."""
        claim = self._claim(seq_ids)
        try:
            future = executor.submit(work)
        except BaseException:
            self._unclaim(claim)
            raise
        future.add_done_callback(lambda _: self._unclaim(claim))
        return future

    def check_stream(self, stream: int) -> None:
        if not 0 <= stream < len(self._queues):
            raise InvalidArgument(f"stream {stream} does not exist; the worker has {len(self._queues)} streams")

    def submit_in_order(self, stream: int, work: Callable[[], object]) -> Future:
        """Runs work after everything already queued on the stream, claiming nothing: for clean-up of sequences
        only this stream's queued work can touch (a cancelled Generate's)."""
        self.check_stream(stream)
        future: Future = Future()
        self._queues[stream].put((future, work, set(), time.perf_counter(), None))
        return future

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()

    def _serve(self, stream: int) -> None:
        work_queue = self._queues[stream]
        self._on_thread_start(stream)
        while (item := work_queue.get()) is not None:
            future, work, claim, enqueued, after = item
            answer = _Answer(future, claim, self._unclaim)
            if not future.set_running_or_notify_cancel():
                answer()
                continue
            queue_us = int((time.perf_counter() - enqueued) * 1e6)
            try:
                answer.result = (work(), queue_us)
            except BaseException as caught:  # handed to the waiting handler
                answer.error = caught
            try:
                if after is not None and answer.error is None:
                    after(answer.result[0], work_queue.empty(), answer)
            except Exception:   # keep the stream alive; the answer still goes out below
                log.exception("stream_follow_up_failed", stream=stream)
            finally:
                answer()

    def _claim(self, seq_ids: list[int]) -> set[int]:
        """Claims the sequences for one piece of work; SequenceBusy where another holds any of them."""
        claim = set(seq_ids)
        with self._claim_lock:
            busy = claim & self._claimed
            if busy:
                raise SequenceBusy(busy)
            self._claimed |= claim
        return claim

    def _unclaim(self, claim: set[int]) -> None:
        with self._claim_lock:
            self._claimed -= claim


class _Answer:
    """Hands one piece of work's outcome to its future, once: claims dropped first, so the handler's next step on
    these sequences is accepted."""

    def __init__(self, future: Future, claim: set[int], unclaim: Callable[[set[int]], None]):
        self.future, self.claim, self.unclaim = future, claim, unclaim
        self.result = self.error = None
        self.sent = False

    def __call__(self) -> None:
        if self.sent:
            return
        self.sent = True
        self.unclaim(self.claim)
        if self.future.cancelled():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)
