"""Two workers of two streams each behind one gateway: concurrent requests spread over them and give the tokens
each gives alone; a prompt whose prefix one worker has cached goes to that worker."""

import asyncio

from metrale.v1 import worker_pb2 as pb
from metrale_gateway.router import Gateway
from metrale_gateway.scheduler import Completion
from test_scheduler import completions, serve


def test_requests_spread_over_workers_and_streams_with_each_ones_tokens(worker, workers):
    alone = asyncio.run(serve(worker.address, completions(16, seed=9), together=False))

    async def through_gateway():
        gateway = Gateway([w.address for w in workers], chunk_tokens=16)
        await gateway.start()
        served = []

        async def collect(completion):
            scheduler = await gateway.route(completion)
            served.append((scheduler.link.address, scheduler.stream))
            return [token async for token in scheduler.tokens(completion)]
        try:
            return await asyncio.gather(*(collect(c) for c in completions(16, seed=9))), served
        finally:
            await gateway.stop()

    together, served = asyncio.run(through_gateway())
    assert list(together) == alone
    assert len(set(served)) == 4            # every stream of both workers took some
    for worker in workers:
        assert worker.stub.Info(pb.InfoRequest()).live_sequences == 0


def test_a_cached_prefix_draws_its_prompt_to_its_worker(workers):
    system = list(range(10, 60))            # three full blocks of 16

    async def run():
        gateway = Gateway([w.address for w in workers])
        await gateway.start()
        try:
            # Nothing cached, nothing running: the first worker takes it.
            first = Completion(prompt=[7, 8], max_tokens=2, ignore_eos=True)
            assert (await gateway.route(first)).link is gateway.links[0]
            # The second worker's cache then holds the system prompt's blocks: it draws the prompt, though the
            # first worker is as idle.
            warm = gateway.schedulers[gateway.links[1]][0]
            [_ async for _ in warm.generate(Completion(prompt=system + [3], max_tokens=2, ignore_eos=True))]
            [_ async for _ in gateway.schedulers[gateway.links[0]][0].tokens(first)]
            chosen_by_prefix = Completion(prompt=system + [4, 5], max_tokens=2, ignore_eos=True)
            chosen = await gateway.route(chosen_by_prefix)
            [_ async for _ in chosen.tokens(chosen_by_prefix)]
            return chosen.link is gateway.links[1]
        finally:
            await gateway.stop()

    assert asyncio.run(run())
