"""The reference gateway's continuous batching against a real worker: concurrent requests give exactly the tokens
each gives alone (greedy), stops end a completion before its stop token, a consumer that goes away has its
sequence released, n completions of one prompt share its prefill through Fork, and what could stall the queue
(a group cancelled mid-prefill, a group that can never fit, a worker's streams over one pool) does not."""

import asyncio
import random
import time

import pytest

from metrale.v1 import worker_pb2 as pb
from metrale_gateway.link import WorkerLink
from metrale_gateway.router import Gateway
from metrale_gateway.scheduler import Completion, Scheduler, TooLarge


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


async def serve_group(address: str, group: list[Completion], beside: list[Completion] = ()) -> list[list[int]]:
    """The group's completions' tokens (n > 1 of one prompt), with other requests running beside it."""
    link = WorkerLink(address)
    await link.open()
    scheduler = Scheduler(link, chunk_tokens=16)
    runner = asyncio.create_task(scheduler.run())

    async def collect(completion):
        return [token async for token in scheduler.tokens(completion)]
    try:
        scheduler.submit_group(group)
        for completion in beside:
            scheduler.submit(completion)
        results = await asyncio.gather(*(collect(c) for c in [*group, *beside]))
        return list(results[:len(group)])
    finally:
        scheduler.stop()
        await runner
        await link.close()


def test_n_greedy_completions_fork_and_match_one_alone(worker):
    """Greedy children continue exactly as one completion alone, beside other requests; all are released."""
    [request] = completions(1, seed=7)
    request.prompt, request.max_tokens = [random.Random(1).randrange(3, 256) for _ in range(37)], 12
    [alone] = asyncio.run(serve(worker.address, [request], together=False))
    group = [Completion(prompt=request.prompt, max_tokens=12, ignore_eos=True) for _ in range(3)]
    assert asyncio.run(serve_group(worker.address, group, beside=completions(4, seed=9))) == [alone] * 3
    assert all(c.finish_reason == "length" for c in group)
    assert worker.stub.Info(pb.InfoRequest()).live_sequences == 0


def test_n_sampled_completions_differ_and_repeat(worker):
    """Sampled forks (the worker derives each one's seed from the first's) take different paths, and the same group
    gives the same tokens again."""
    prompt = [random.Random(2).randrange(3, 256) for _ in range(20)]

    def group():
        return [Completion(prompt=prompt, max_tokens=16, ignore_eos=True,
                           sampling=pb.SamplingParams(temperature=1.0, seed=100)) for _ in range(2)]
    first = asyncio.run(serve_group(worker.address, group()))
    assert first == asyncio.run(serve_group(worker.address, group()))
    assert first[0] != first[1]
    assert worker.stub.Info(pb.InfoRequest()).live_sequences == 0


def test_a_one_token_prompt_group_runs_each_alone(worker):
    group = [Completion(prompt=[9], max_tokens=5, ignore_eos=True) for _ in range(2)]
    first, second = asyncio.run(serve_group(worker.address, group))
    assert first == second and len(first) == 5


def test_a_stop_string_ends_the_completion_before_it(default_worker):
    """The text of a greedy completion, then the same request stopped at a string from the middle of it: the text
    up to its first occurrence, the tokens before the one that completed it."""
    prompt = list(default_worker.stub.Tokenize(pb.TokenizeRequest(text="The capital of France is")).tokens)
    full = Completion(prompt=prompt, max_tokens=24, ignore_eos=True, stop=("\u0000never",))
    [tokens] = asyncio.run(serve(default_worker.address, [full], together=False))
    text = default_worker.stub.Detokenize(pb.DetokenizeRequest(tokens=tokens, skip_special_tokens=True)).text
    assert full.text == text and full.finish_reason == "length"
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = Completion(prompt=prompt, max_tokens=24, ignore_eos=True, stop=("zzzz-unseen", stop))
    [cut] = asyncio.run(serve(default_worker.address, [stopped], together=False))
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.index(stop)]
    assert cut == tokens[:len(cut)] and len(cut) < len(tokens)
    assert default_worker.stub.Info(pb.InfoRequest()).live_sequences == 0


def test_a_stop_string_without_a_tokenizer_fails_that_completion_alone(worker):
    """The tiny model has no tokenizer: Detokenize fails, so the completion with stop strings ends with the error,
    and the one beside it runs to its end."""
    with_stop = Completion(prompt=[5, 6, 7], max_tokens=8, ignore_eos=True, stop=("x",))
    plain = Completion(prompt=[8, 9], max_tokens=8, ignore_eos=True)

    async def run():
        link = WorkerLink(worker.address)
        await link.open()
        scheduler = Scheduler(link)
        runner = asyncio.create_task(scheduler.run())
        scheduler.submit(with_stop)
        scheduler.submit(plain)
        try:
            failed = None
            try:
                [t async for t in scheduler.tokens(with_stop)]
            except Exception as error:
                failed = error
            return failed, [t async for t in scheduler.tokens(plain)]
        finally:
            scheduler.stop()
            await runner
            await link.close()

    failed, tokens = asyncio.run(run())
    assert failed is not None and "tokenizer" in str(failed).lower() and with_stop.finish_reason == "error"
    assert len(tokens) == 8 and plain.finish_reason == "length"


async def with_scheduler(address: str, body, chunk_tokens: int = 8):
    """body(scheduler, link) against a running scheduler on one stream; the scheduler must outlive it."""
    link = WorkerLink(address)
    await link.open()
    scheduler = Scheduler(link, chunk_tokens=chunk_tokens)
    runner = asyncio.create_task(scheduler.run())
    try:
        return await body(scheduler, link)
    finally:
        assert not runner.done(), runner.exception()
        scheduler.stop()
        await runner
        await link.close()


async def collect(scheduler, completion):
    return [t async for t in scheduler.tokens(completion)]


def test_a_group_cancelled_mid_prefill_leaves_the_scheduler_running(worker):
    """Every completion of an n = 3 group gone while its prompt is still being sent (before the fork): the
    scheduler goes on, a later request runs, nothing stays live."""
    async def body(scheduler, link):
        group = [Completion(prompt=list(range(10, 50)), max_tokens=10, ignore_eos=True) for _ in range(3)]
        scheduler.submit_group(group)
        tasks = [asyncio.create_task(collect(scheduler, c)) for c in group]
        while not any(r.prefilled for r in scheduler._running.values()):
            await asyncio.sleep(0.001)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        later = Completion(prompt=[5, 6, 7], max_tokens=3, ignore_eos=True)
        scheduler.submit(later)
        return await asyncio.wait_for(collect(scheduler, later), 10)
    assert len(asyncio.run(with_scheduler(worker.address, body))) == 3
    for _ in range(100):
        if worker.stub.Info(pb.InfoRequest()).live_sequences == 0:
            break
        time.sleep(0.02)
    assert worker.stub.Info(pb.InfoRequest()).live_sequences == 0


def test_a_group_that_can_never_fit_fails_and_the_queue_goes_on(worker):
    async def body(scheduler, link):
        group = [Completion(prompt=list(range(10, 20)), max_tokens=86, ignore_eos=True) for _ in range(16)]
        scheduler.submit_group(group)
        later = Completion(prompt=[5, 6, 7], max_tokens=3, ignore_eos=True)
        scheduler.submit(later)
        with pytest.raises(TooLarge, match="KV blocks"):
            await collect(scheduler, group[0])
        return await asyncio.wait_for(collect(scheduler, later), 10)
    assert len(asyncio.run(with_scheduler(worker.address, body))) == 3


def test_a_workers_streams_share_its_blocks(workers):
    """20 requests whose reservations together pass one worker's pool, over its two streams: none fails for
    blocks (each waits for room), and every reservation is returned."""
    async def run():
        gateway = Gateway([workers[0].address])
        await gateway.start()
        try:
            requests = [Completion(prompt=[10 + i] * 10, max_tokens=86, ignore_eos=True) for i in range(20)]
            lengths = await asyncio.gather(*(collect_gateway(gateway, c) for c in requests))
            return lengths, [s._reserved.blocks for s in gateway.schedulers[gateway.links[0]]]
        finally:
            await gateway.stop()

    lengths, reserved = asyncio.run(run())
    assert lengths == [86] * 20 and reserved == [0, 0]


async def collect_gateway(gateway, completion):
    return len([t async for t in gateway.generate(completion)])
