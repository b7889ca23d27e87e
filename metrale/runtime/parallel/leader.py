"""Rank 0's runner in a tensor-parallel worker: the engine's, with every call that changes what the ranks hold (the
cache's allocation, forwards, encoder passes, cache copies, warm-up) sent to the other ranks before it runs here.
They run the same calls in the same order (follower.py), so each forward's collectives meet across the ranks; one
call at a time, so two streams' forwards cannot cross, each with the stream its caller is bound to (the others run
it on theirs). A call that fails partway, on this rank or another, fails alone: every rank leaves its collectives and
they make new ones at RENEW before the next call. Once a rank is gone (GlooGroup.lose), every call is RankLost, and so
is a sampling whose wait on the device that rank's loss ended. Where the device works ahead of the host (CUDA), a
wait on it that outlasts the collectives' timeout loses the ranks too (DeviceWatch): NCCL waits for a hung rank's
part without end."""

import contextlib
import dataclasses
import threading
import time

from metrale.runtime.backend.runner import Runner
from metrale.runtime.errors import CollectiveFailed

STOP = ("stop",)
RENEW = ("renew",)


class LeaderRunner:
    def __init__(self, runner: Runner, group):
        self.runner, self.group = runner, group
        self.lock = threading.Lock()
        self.concurrent_forwards = False
        self._bound = threading.local()         # the calling thread's stream
        self.watch = DeviceWatch(group, group.timeout.total_seconds()) if runner.queues_work else None

    def __getattr__(self, name):
        """What only rank 0 does (planning, beam candidates, counters) or keeps to itself."""
        return getattr(self.runner, name)

    def bind_stream(self, stream: int) -> None:
        self.runner.bind_stream(stream)
        self._bound.stream = stream

    def _mirrored(self, message: tuple, run, watched: bool = True):
        """message: (call, *args), sent as (call, the caller's stream, *args). watched: what run() waits for on the
        device is bounded by the watch (not the warm-up's tuning and captures, nor the cache's allocation)."""
        with self.lock:
            self.group.check()
            generation = self._bound.generation = self.group.generation
            self.group.send((message[0], getattr(self._bound, "stream", 0), *message[1:]))
            try:
                with self.waiting() if watched else contextlib.nullcontext():
                    result = run()
                self._settled(generation)
                return result
            except BaseException:
                if self.group.lost is None:
                    self._recover()
                raise

    def waiting(self):
        """Around a wait on the device: bounded by the watch, where there is one."""
        return self.watch.waiting() if self.watch is not None else contextlib.nullcontext()

    def _settled(self, generation: int) -> None:
        """After a wait on the device for work queued under the collectives' `generation`: RankLost once a rank is
        gone; CollectiveFailed where another rank's part of the step failed, or the collectives were renewed since
        (either way they were aborted, which ended the wait: what it got is not the model's)."""
        self.group.check()
        if self.group.interrupted or (self.runner.queues_work and self.group.generation != generation):
            raise CollectiveFailed("another tensor-parallel rank's part of the step failed")

    def _forward_generation(self) -> int:
        """The collectives' generation the calling thread's latest forward was queued under (what its sampling
        reads), whatever renewal came since."""
        return getattr(self._bound, "generation", self.group.generation)

    def queue_sample(self, logits, rows):
        return CheckedSample(self.runner.queue_sample(logits, rows), self, self._forward_generation())

    def beam_candidates(self, logits, banned, count):
        return CheckedCandidates(self.runner.beam_candidates(logits, banned, count), self,
                                 self._forward_generation())

    def synchronize(self) -> None:
        self.checked_wait(self.runner.synchronize, self.group.generation)

    def checked_wait(self, wait, generation: int):
        """wait() (on the device, outside a mirrored call: a sampling's read-back), watched, then _settled for work
        queued under `generation`; an interrupted step's collectives are renewed here, once, by the first wait to
        see it."""
        with self.waiting():
            result = wait()
        try:
            self._settled(generation)
        except CollectiveFailed:
            with self.lock:
                if self.group.interrupted and self.group.lost is None:
                    self._recover()
            raise
        return result

    def _recover(self) -> None:
        """After a call that failed partway: this rank leaves its collectives (another rank in one fails it at
        once), says it renews them (a rank waiting on its device for collectives this one never queued stops
        waiting), then every rank makes new ones (RankLost where one cannot be reached)."""
        self.group.drop_collectives()
        self.group.announce_renewal()
        self.group.send(RENEW)
        self.group.renew_collectives()

    def when_lost(self, callback) -> None:
        """callback(why) once the ranks are lost to a wait past the collectives' timeout (the server's health), and
        now where they are lost already."""
        if self.watch is not None:
            self.watch.on_lost = callback
        if self.group.lost is not None:
            callback(self.group.lost)

    def allocate_cache(self, specs, num_blocks, block_size, num_state_slots):
        """Rank 0 sizes the cache; each rank allocates its shard of it (its model's specs)."""
        return self._mirrored(("allocate_cache", num_blocks, block_size, num_state_slots),
                              lambda: self.runner.allocate_cache(specs, num_blocks, block_size, num_state_slots),
                              watched=False)

    def warm_up(self, forward, graph_batch_sizes, max_context, max_source_len=0):
        return self._mirrored(("warm_up", graph_batch_sizes, max_context, max_source_len),
                              lambda: self.runner.warm_up(forward, graph_batch_sizes, max_context, max_source_len),
                              watched=False)

    def run_forward(self, forward, batch, replayable):
        return self._mirrored(("forward", _sendable(batch), replayable),
                              lambda: self.runner.run_forward(forward, batch, replayable))

    def run_encoder(self, encode, batch, replayable):
        return self._mirrored(("encode", _sendable(batch), replayable),
                              lambda: self.runner.run_encoder(encode, batch, replayable))

    def device_search(self, search, forward, layers):
        return None         # the host steps beam searches: each step's forward is then mirrored like any other

    def copy_block_prefixes(self, layers, copies):
        return self._mirrored(("copy_blocks", copies), lambda: self.runner.copy_block_prefixes(layers, copies))

    def copy_state_slots(self, layers, copies):
        return self._mirrored(("copy_states", copies), lambda: self.runner.copy_state_slots(layers, copies))

    def lose(self, why: str) -> None:
        """Another rank is gone (RankWatch): a step waiting for its part on the device ends, and every call is
        RankLost from now on."""
        self.group.lose(why)

    def stop(self) -> None:
        """Ends the other ranks' loops (where they can still be reached) and leaves the group, so that this process
        can join another."""
        with self.lock:
            if self.watch is not None:
                self.watch.stop()
            try:
                self.group.send(STOP)
            finally:
                self.group.close()


class CheckedSample:
    """A queued sampling whose result is RankLost where a rank was lost meanwhile: its logits lacked that rank's part
    (the wait for them ended with the collectives' abort, not with the part)."""

    __slots__ = ("queued", "leader", "generation")

    def __init__(self, queued, leader: LeaderRunner, generation: int):
        self.queued, self.leader, self.generation = queued, leader, generation

    def result(self):
        return self.leader.checked_wait(self.queued.result, self.generation)


class CheckedCandidates:
    """A beam step's queued candidates (Runner.beam_candidates') whose host() is checked as CheckedSample's result."""

    def __init__(self, candidates, leader: LeaderRunner, generation: int):
        self.candidates, self.leader, self.generation = candidates, leader, generation

    def __getattr__(self, name):
        return getattr(self.candidates, name)

    def host(self):
        return self.leader.checked_wait(self.candidates.host, self.generation)


class DeviceWatch:
    """Rank 0's watch over its waits for the device, on a thread of its own. NCCL waits for another rank's part of a
    collective without end, so while rank 0 waits: where that rank's part of the call failed (it said so,
    GlooGroup.report_failure), the wait is interrupted (GlooGroup.interrupt: the collectives are aborted, the step
    fails alone and the ranks renew them); a wait that outlasts timeout_s (the collectives' timeout) means that rank
    hangs, and the ranks are lost (GlooGroup.lose: every call RankLost from then on)."""

    TICK_S = 0.1

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.on_lost = lambda why: None         # LeaderRunner.when_lost's
        self._deadlines: dict[int, float] = {}      # thread -> when its wait is over time
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="metrale-device-watch", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self):
        thread = threading.get_ident()
        self._deadlines[thread] = time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            del self._deadlines[thread]

    def _watch(self) -> None:
        while not self._stopped.wait(min(self.TICK_S, self.timeout_s / 4)):
            deadlines = list(self._deadlines.values())
            if not deadlines or self.group.lost is not None:
                continue
            if min(deadlines) < time.monotonic():
                why = f"a wait on the device passed {self.timeout_s:g} s (a rank hangs)"
                self.group.lose(why)
                self.on_lost(why)
            elif not self.group.interrupted and self._failure_reported():
                self.group.interrupt()

    def _failure_reported(self) -> bool:
        try:
            return self.group.failure_reported()
        except RuntimeError:        # the store unreachable: a lost rank's watch (RankWatch) says so
            return False

    def stop(self) -> None:
        self._stopped.set()


def _sendable(batch):
    """The batch without what rank 0's runner staged for itself (each rank stages its own)."""
    cross = batch.cross and _sendable(batch.cross)
    return dataclasses.replace(batch, staged=None, cross=cross)
