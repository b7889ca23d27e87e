"""Starts a tensor-parallel worker's other ranks as processes of their own (spawned: no state of rank 0's is
inherited, the environment is), each loading the checkpoint itself and following rank 0's calls until it stops them
or goes away; and rank 0's watch over them (RankWatch)."""

import multiprocessing
import multiprocessing.connection
import socket
import threading
from pathlib import Path
from typing import Callable

from metrale.runtime.build import build_follower
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.parallel.follower import follow
from metrale.runtime.parallel.group import GlooGroup, Shard


def free_address() -> str:
    """A local TCP address for rank 0 to meet the others at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_followers(model_path: str, config: EngineConfig, size: int, address: str, cache_dir: str | None
                    ) -> list[multiprocessing.Process]:
    """Ranks 1 .. size - 1, started; daemonic, so they end with rank 0's process."""
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=run_follower, args=(model_path, config, rank, size, address, cache_dir),
                             name=f"metrale-rank-{rank}", daemon=True) for rank in range(1, size)]
    for rank in ranks:
        rank.start()
    return ranks


def run_follower(model_path: str, config: EngineConfig, rank: int, size: int, address: str, cache_dir: str | None
                 ) -> None:
    group = GlooGroup(Shard(rank, size), address)
    model, runner, specs = build_follower(load_checkpoint(Path(model_path)), config, group,
                                          Path(cache_dir) if cache_dir else None)
    follow(group, model, runner, specs)
    group.close()


class RankWatch:
    """Rank 0's watch over the other ranks' processes, on a thread of its own: the first one to end before stop()
    calls on_lost(why), once. A rank's collectives on the device wait for its part without end (NCCL has no timeout):
    on_lost is what ends that wait (GlooGroup.lose) and turns the worker NOT_SERVING, whether a step is under way
    or none is."""

    def __init__(self, ranks: list[multiprocessing.Process], on_lost: Callable[[str], None]):
        """on_lost may be replaced later (the server's, once it serves, after the build's)."""
        self.on_lost = on_lost
        self._stopped, self._stop = multiprocessing.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._watch, args=(ranks,), name="metrale-rank-watch", daemon=True)
        self._thread.start()

    def _watch(self, ranks) -> None:
        by_sentinel = {rank.sentinel: rank for rank in ranks}
        ended = multiprocessing.connection.wait([*by_sentinel, self._stopped])
        if self._stopped in ended:
            return
        rank = by_sentinel[ended[0]]
        rank.join(timeout=1)
        self.on_lost(f"{rank.name} ended (exit code {rank.exitcode})")

    def stop(self) -> None:
        """Ends the watch (before the ranks are stopped on purpose)."""
        self._stop.send(None)
        self._thread.join()
