"""Rank 0's runner in a tensor-parallel worker: the engine's, with every call that changes what the ranks hold (the
cache's allocation, forwards, encoder passes, cache copies, warm-up) sent to the other ranks before it runs here.
They run the same calls in the same order (follower.py), so each forward's collectives meet across the ranks; one
call at a time, so two streams' forwards cannot cross, each with the stream its caller is bound to (the others run
it on theirs). A call that fails partway, on this rank or another, fails alone: every rank leaves its collectives and
they make new ones at RENEW before the next call. Once a rank is gone (GlooGroup.lose), every call is RankLost, and so
is a sampling whose wait on the device that rank's loss ended."""

import dataclasses
import threading

from metrale.runtime.backend.runner import Runner

STOP = ("stop",)
RENEW = ("renew",)


class LeaderRunner:
    def __init__(self, runner: Runner, group):
        self.runner, self.group = runner, group
        self.lock = threading.Lock()
        self.concurrent_forwards = False
        self._bound = threading.local()         # the calling thread's stream

    def __getattr__(self, name):
        """What only rank 0 does (planning, beam candidates, counters) or keeps to itself."""
        return getattr(self.runner, name)

    def bind_stream(self, stream: int) -> None:
        self.runner.bind_stream(stream)
        self._bound.stream = stream

    def _mirrored(self, message: tuple, run):
        """message: (call, *args), sent as (call, the caller's stream, *args)."""
        with self.lock:
            self.group.check()
            self.group.send((message[0], getattr(self._bound, "stream", 0), *message[1:]))
            try:
                return run()
            except BaseException:
                self._recover()
                raise

    def queue_sample(self, logits, rows):
        return CheckedSample(self.runner.queue_sample(logits, rows), self.group)

    def synchronize(self) -> None:
        self.runner.synchronize()
        self.group.check()

    def _recover(self) -> None:
        """After a call that failed partway: this rank leaves its collectives (another rank in one fails it at
        once), then every rank makes new ones (RankLost where one cannot be reached)."""
        self.group.drop_collectives()
        self.group.send(RENEW)
        self.group.renew_collectives()

    def allocate_cache(self, specs, num_blocks, block_size, num_state_slots):
        """Rank 0 sizes the cache; each rank allocates its shard of it (its model's specs)."""
        return self._mirrored(("allocate_cache", num_blocks, block_size, num_state_slots),
                              lambda: self.runner.allocate_cache(specs, num_blocks, block_size, num_state_slots))

    def warm_up(self, forward, graph_batch_sizes, max_context, max_source_len=0):
        return self._mirrored(("warm_up", graph_batch_sizes, max_context, max_source_len),
                              lambda: self.runner.warm_up(forward, graph_batch_sizes, max_context, max_source_len))

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
            try:
                self.group.send(STOP)
            finally:
                self.group.close()


class CheckedSample:
    """A queued sampling whose result is RankLost where a rank was lost meanwhile: its logits lacked that rank's part
    (the wait for them ended with the collectives' abort, not with the part)."""

    __slots__ = ("queued", "group")

    def __init__(self, queued, group):
        self.queued, self.group = queued, group

    def result(self):
        result = self.queued.result()
        self.group.check()
        return result


def _sendable(batch):
    """The batch without what rank 0's runner staged for itself (each rank stages its own)."""
    cross = batch.cross and _sendable(batch.cross)
    return dataclasses.replace(batch, staged=None, cross=cross)
