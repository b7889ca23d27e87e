"""The reference gateway's continuous batching against a real worker: concurrent requests give exactly the tokens
each gives alone (greedy), stops end a completion before its stop token, and a consumer that goes away has its
sequence released."""

import asyncio
import random

from metrale.v1 import worker_pb2 as pb
from metrale_gateway.link import WorkerLink
from metrale_gateway.scheduler import Completion, Scheduler


def completions(count: int, seed: int = 0) -> list[Completion]:
    rng = random.Random(seed)
    return [Completion(prompt=[rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))],
                       max_tokens=rng.randrange(1, 30), ignore_eos=True) for _ in range(count)]


async def serve(address: str, requests: list[Completion], together: bool, chunk_tokens: int = 16) -> list[list[int]]:
    """Each request's tokens, run all at once (together) or one after another, through one scheduler."""
    link = WorkerLink(address)
    await link.open()
    scheduler = Scheduler(link, chunk_tokens=chunk_tokens)
    runner = asyncio.create_task(scheduler.run())

    async def collect(completion):
        return [token async for token in scheduler.generate(completion)]
    try:
        if together:
            return list(await asyncio.gather(*(collect(c) for c in requests)))
        return [await collect(c) for c in requests]
    finally:
        scheduler.stop()
        await runner
        await link.close()


def test_concurrent_requests_give_the_tokens_each_gives_alone(worker):
    alone = asyncio.run(serve(worker.address, completions(24), together=False))
    together = asyncio.run(serve(worker.address, completions(24), together=True))
    assert together == alone
    assert all(len(tokens) == c.max_tokens for tokens, c in zip(together, completions(24)))
    assert worker.stub.Info(pb.InfoRequest()).live_sequences == 0


def test_a_stop_token_ends_the_completion_before_it(worker):
    [request] = completions(1, seed=3)
    request.max_tokens = 20
    [tokens] = asyncio.run(serve(worker.address, [request], together=False))
    stop = tokens[5]
    stopped = Completion(prompt=request.prompt, max_tokens=20, ignore_eos=True, stop_token_ids=frozenset({stop}))
    [cut] = asyncio.run(serve(worker.address, [stopped], together=False))
    assert cut == tokens[:tokens.index(stop)] and stopped.finish_reason == "stop"


def test_a_consumer_that_leaves_has_its_sequence_released(worker):
    async def leave_early():
        link = WorkerLink(worker.address)
        await link.open()
        scheduler = Scheduler(link)
        runner = asyncio.create_task(scheduler.run())
        stream = scheduler.generate(Completion(prompt=[5, 6, 7], max_tokens=50, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()                    # the client disconnects after one token
        for _ in range(100):
            if (await link.stub.Info(pb.InfoRequest())).live_sequences == 0:
                break
            await asyncio.sleep(0.02)
        live = (await link.stub.Info(pb.InfoRequest())).live_sequences
        scheduler.stop()
        await runner
        await link.close()
        return first, live

    first, live = asyncio.run(leave_early())
    assert isinstance(first, int) and live == 0
