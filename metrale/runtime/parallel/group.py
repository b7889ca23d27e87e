"""The ranks of a tensor-parallel worker and their collectives: a sum over the ranks, a gather along the last dim,
and rank 0's calls handed to the others (leader.py, follower.py). Over torch.distributed's gloo on the CPU backend
(CI proves the sharded math with processes on one machine), in process groups of the worker's own, not
torch.distributed's global one: a process may hold several workers' groups, one after another or at once (the
tests' in-process workers)."""

import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from metrale.runtime.errors import CollectiveFailed, InvalidArgument, RankLost


@dataclass(frozen=True)
class Shard:
    """This rank's place in the group: rank of size."""
    rank: int
    size: int

    def divided(self, count: int, what: str) -> int:
        """count / size, where the size divides it (InvalidArgument naming what otherwise)."""
        if count % self.size:
            raise InvalidArgument(f"{what} ({count}) is not a multiple of --tensor-parallel {self.size}")
        return count // self.size

    def part(self, length: int, what: str) -> slice:
        """The rank's equal part of `length`."""
        step = self.divided(length, what)
        return slice(self.rank * step, (self.rank + 1) * step)


# How long the other ranks wait for rank 0's next call: a worker may sit idle for as long as no one calls it.
CALL_WAIT = timedelta(days=365)


class GlooGroup:
    """The ranks joined at address (host:port, rank 0 listens) over gloo. timeout_s bounds every collective of a
    forward, so a rank that hangs fails the step; the wait for rank 0's next call is unbounded, and a rank that
    exits (or whose machine drops it) fails it at once. A forward that fails partway on any rank leaves its
    collectives (drop_collectives: the others' fail at once, their peer gone) and the ranks make new ones together
    (renew_collectives, at rank 0's word: leader.py)."""

    def __init__(self, shard: Shard, address: str, timeout_s: float = 60.0):
        self.shard, self.timeout, self.generation = shard, timedelta(seconds=timeout_s), 0
        self.device = None          # a backend's collectives of its own (the CUDA backend's NCCL): attach()
        self.lost: str | None = None    # why the ranks cannot go on (lose()), once one is gone
        self.interrupted = False        # the device's collectives aborted for a rank's failed call (interrupt())
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), shard.size, shard.rank == 0, timeout=CALL_WAIT)
        self.calls = dist.ProcessGroupGloo(dist.PrefixStore("calls", self.store), shard.rank, shard.size, CALL_WAIT)
        self.collectives = self._collectives()
        self.store.set_timeout(self.timeout)        # renewals meet within the collectives' timeout

    def _collectives(self):
        return dist.ProcessGroupGloo(dist.PrefixStore(f"collectives.{self.generation}", self.store), self.shard.rank,
                                     self.shard.size, self.timeout)

    def attach(self, device) -> None:
        """A backend's collectives over the device (renew(), detach(), close()): renewed with the group's, at RENEW,
        and taken out of use where a rank is lost or a wait interrupted."""
        self.device = device

    def drop_collectives(self) -> None:
        """Leaves the current collectives: another rank in one (or entering one) fails it at once. (The device's
        run on: no host waits in them, and every rank aborts them together at the renewal.)"""
        self.collectives = None

    def renew_collectives(self) -> None:
        """New collectives, made by every rank together (each within the collectives' timeout, else RankLost)."""
        self.generation += 1
        try:
            self.collectives = self._collectives()
            if self.device is not None:
                self.device.renew()
        except (RuntimeError, RankLost) as error:   # gloo's meeting, or the device's collectives' (RankLost)
            why = f"the ranks did not meet again after a failed call: {error}"
            self.lose(why)
            raise RankLost(f"tensor-parallel {why}") from error
        self.interrupted = False

    def announce_renewal(self) -> None:
        """Rank 0, before RENEW: for a rank whose device waits on collectives rank 0 never queued (renewing()),
        which then stops waiting and reads RENEW."""
        self.store.set(f"renew.{self.generation}", "")

    def renewing(self) -> bool:
        """Another rank: whether rank 0 is renewing the collectives of this generation."""
        return self.store.check([f"renew.{self.generation}"])

    def report_failure(self) -> None:
        """A rank other than 0 whose part of a call failed: says so, for rank 0 waiting on the device for that part
        (its DeviceWatch interrupts the wait)."""
        self.store.set(f"failed.{self.generation}", str(self.shard.rank))

    def failure_reported(self) -> bool:
        """Rank 0: whether another rank's part of a call under this generation failed."""
        return self.store.check([f"failed.{self.generation}"])

    def interrupt(self) -> None:
        """Rank 0, another rank's part of the step having failed: the device's collectives are aborted (from a
        thread of their own), which ends the wait for that part; the step then fails and the ranks renew them."""
        self.interrupted = True
        self._abort_device()

    def lose(self, why: str) -> None:
        """Another rank is gone (its process ended, or it hangs): the collectives are left and the device's aborted,
        so that a step waiting on the device for that rank's part ends, and every later call is RankLost (check()).
        From any thread."""
        self.lost = why
        self.drop_collectives()
        self._abort_device()

    def _abort_device(self) -> None:
        """The device's collectives taken out of use here, and aborted on a thread of their own: the abort may wait
        (for the graphs that captured them, let go of at the renewal) and must not hold the caller."""
        communicator = self.device.detach() if self.device is not None else None
        if communicator is not None:
            threading.Thread(target=self.device.abort_detached, args=(communicator,), name="metrale-collectives-abort",
                             daemon=True).start()

    def check(self) -> None:
        """RankLost once a rank is gone: what a step that waited on the device got is not the model's."""
        if self.lost is not None:
            raise RankLost(f"a tensor-parallel rank is gone: {self.lost}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks (in float32, then in x's dtype): every rank gets the same sum."""
        total = x.float().contiguous()
        try:
            self._current().allreduce([total]).wait()
        except RuntimeError as error:
            raise CollectiveFailed(f"tensor-parallel sum failed: {error}") from error
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dim in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.shard.size)]
        try:
            self._current().allgather([parts], [x.contiguous()]).wait()
        except RuntimeError as error:
            raise CollectiveFailed(f"tensor-parallel gather failed: {error}") from error
        return torch.cat(parts, dim=-1)

    def _current(self):
        if self.collectives is None:
            raise CollectiveFailed("tensor-parallel collectives left after a failed call, not yet renewed")
        return self.collectives

    def send(self, message) -> None:
        """Rank 0: a picklable message to every other rank, in the order sent."""
        self._broadcast(pickle.dumps(message))

    def receive(self):
        """Another rank: rank 0's next message."""
        return pickle.loads(self._broadcast(b""))

    def _broadcast(self, payload: bytes) -> bytes:
        """Rank 0's payload on every rank: its length, then its bytes."""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        try:
            self.calls.broadcast(length, 0).wait()
            data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.shard.rank == 0
                    else torch.empty(int(length[0]), dtype=torch.uint8))
            self.calls.broadcast(data, 0).wait()
        except RuntimeError as error:
            raise RankLost(f"tensor-parallel message failed: {error}") from error
        return data.numpy().tobytes()

    def close(self) -> None:
        """Leaves the group: its connections close with it."""
        if self.device is not None:
            self.device.close()
        self.calls = self.collectives = self.store = self.device = None
