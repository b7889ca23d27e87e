"""The ranks of a tensor-parallel worker and their collectives: a sum over the ranks, a gather along the last dim,
and rank 0's calls handed to the others (leader.py, follower.py). Over torch.distributed's gloo on the CPU backend
(CI proves the sharded math with processes on one machine)."""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from metrale.runtime.errors import InvalidArgument, RankLost


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
    exits (or whose machine drops it) fails it at once."""

    def __init__(self, shard: Shard, address: str, timeout_s: float = 60.0):
        self.shard = shard
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=shard.rank, world_size=shard.size,
                                timeout=CALL_WAIT)
        self.collectives = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks (in float32, then in x's dtype): every rank gets the same sum."""
        total = x.float().contiguous()
        try:
            dist.all_reduce(total, group=self.collectives)
        except RuntimeError as error:
            raise RankLost(f"tensor-parallel sum failed: {error}") from error
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dim in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.shard.size)]
        try:
            dist.all_gather(parts, x.contiguous(), group=self.collectives)
        except RuntimeError as error:
            raise RankLost(f"tensor-parallel gather failed: {error}") from error
        return torch.cat(parts, dim=-1)

    def send(self, message) -> None:
        """Rank 0: a picklable message to every other rank, in the order sent."""
        self._broadcast(message)

    def receive(self):
        """Another rank: rank 0's next message."""
        return self._broadcast(None)

    def _broadcast(self, message):
        box = [message]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as error:
            raise RankLost(f"tensor-parallel message failed: {error}") from error
        return box[0]

    def close(self) -> None:
        dist.destroy_process_group()
