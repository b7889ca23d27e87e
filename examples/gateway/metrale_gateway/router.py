"""Every stream of every worker behind one gateway: a new completion goes to the worker holding the longest cached
prefix of its prompt (MatchPrefix), among equals to the one with the fewest requests, and there to its least loaded
stream."""

import asyncio
import itertools

from metrale.v1 import worker_pb2 as pb
from metrale_gateway.link import WorkerLink
from metrale_gateway.scheduler import Completion, Reservations, Scheduler


class Gateway:
    """start(), then generate() from any task on the loop; stop() at the end."""

    def __init__(self, addresses: list[str], chunk_tokens: int = 512):
        self.links = [WorkerLink(address) for address in addresses]
        self.chunk_tokens = chunk_tokens
        self.schedulers: dict[WorkerLink, list[Scheduler]] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for link in self.links:
            await link.open()
            seq_ids = itertools.count(1)        # one worker's ids and KV reservations, shared by its streams
            reservations = Reservations()
            self.schedulers[link] = [Scheduler(link, stream, self.chunk_tokens, seq_ids, reservations)
                                     for stream in range(link.info.num_streams)]
            self._tasks += [asyncio.create_task(s.run()) for s in self.schedulers[link]]

    async def route(self, *group: Completion, fork: bool = True) -> Scheduler:
        """Submits a new completion (or several of one prompt: Scheduler.submit_group) to the scheduler chosen for
        it, and returns that scheduler. The choice and the submission run without a pause between them, so that
        concurrent routes see each other's load."""
        cached = await asyncio.gather(*(link.stub.MatchPrefix(pb.MatchPrefixRequest(tokens=group[0].prompt))
                                        for link in self.links))

        def score(i: int) -> tuple[int, int]:
            return cached[i].cached_tokens, -sum(s.load for s in self.schedulers[self.links[i]])
        best = max(range(len(self.links)), key=score)                    # the first among equals
        scheduler = min(self.schedulers[self.links[best]], key=lambda s: s.load)
        scheduler.submit_group(list(group), fork)
        return scheduler

    async def generate(self, completion: Completion):
        """The completion's tokens as they come, from the worker route() chose."""
        scheduler = await self.route(completion)
        async for token in scheduler.tokens(completion):
            yield token

    async def stop(self) -> None:
        for schedulers in self.schedulers.values():
            for scheduler in schedulers:
                scheduler.stop()
        await asyncio.gather(*self._tasks)
        for link in self.links:
            await link.close()
