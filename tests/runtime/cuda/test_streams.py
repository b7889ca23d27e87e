"""Streams on the CUDA backend: two threads, each bound to its own stream, decode their own sequences at once and
get exactly what the same sequences get decoded on one stream one after the other; each stream has its own stream and
replays its own decode graphs."""

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import write_tiny

pytestmark = pytest.mark.gpu
STEPS = 16
GRAPH_SIZES = (1, 2, 4, 8)
LOGPROBS = OutputOptions(logprobs=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streams")
    directory = write_tiny("llama_tied", folder / "llama_tied", weight_std=0.04, norm_std=0.1)
    # No prefix cache: the same prompts decode twice, and must run alike (not from cache) the second time.
    config = EngineConfig(device="cuda", kv_blocks=256, max_batch_tokens=1024, max_seqs=16, num_streams=2,
                          cuda_graph_batch_sizes=GRAPH_SIZES, prefix_cache=False)
    engine, _ = build_engine(load_checkpoint(directory), config, folder / "cache")
    return engine


def random_prompts(first_id: int, lengths: list[int], seed: int) -> dict[int, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {first_id + i: torch.randint(0, 256, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


def generate(engine, prompts: dict[int, list[int]]) -> dict[int, list[tuple[int, float]]]:
    """Greedy (token, logprob) of each sequence: its prefill's, then STEPS decode steps of all of them together."""
    out = engine.step(Step(prefill=tuple(PrefillSlice(i, tuple(p), output=LOGPROBS) for i, p in prompts.items())))
    produced = {o.seq_id: [(o.token, o.logprob)] for o in out.outputs}
    for _ in range(STEPS):
        out = engine.step(Step(decode=tuple(DecodeToken(i, produced[i][-1][0]) for i in prompts)))
        for o in out.outputs:
            produced[o.seq_id].append((o.token, o.logprob))
    engine.release(list(prompts))
    return produced


def assert_same(got: dict, want: dict) -> None:
    for seq_id, expected in want.items():
        assert [token for token, _ in got[seq_id]] == [token for token, _ in expected], f"seq_id {seq_id}"
        assert [lp for _, lp in got[seq_id]] == pytest.approx([lp for _, lp in expected], abs=1e-5), f"seq_id {seq_id}"


def on_streams(engine, work: list):
    """work[i]() on a thread bound to stream i, all of them started together; their results in stream order."""
    runner = engine.runner
    together = threading.Barrier(len(work), timeout=60)

    def run(stream: int):
        runner.bind_stream(stream)
        together.wait()
        return work[stream]()

    with ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(run, stream) for stream in range(len(work))]
        return [future.result() for future in futures]


def test_streams_decode_at_once_as_one_stream_does_in_turn(engine):
    runner = engine.runner
    assert runner.concurrent_forwards and len(runner.streams) == 2
    # Three sequences a stream (the 4-row graph), prompts of different lengths (their prefills run eagerly).
    groups = [random_prompts(10, [5, 17, 30], seed=1), random_prompts(20, [9, 26, 41], seed=2)]
    in_turn = [generate(engine, prompts) for prompts in groups]    # this thread never bound a stream: stream 0
    replays = [ctx.graphs.replays for ctx in runner.streams]
    at_once = on_streams(engine, [functools.partial(generate, engine, prompts) for prompts in groups])
    assert [ctx.graphs.replays for ctx in runner.streams] == [count + STEPS for count in replays]
    for got, want in zip(at_once, in_turn):
        assert_same(got, want)


def test_each_stream_has_its_own_cuda_stream(engine):
    runner = engine.runner
    handles = {int(ctx.stream.handle) for ctx in runner.streams}
    assert len(handles) == 2 and int(runner.cuda.stream.handle) not in handles
    assert on_streams(engine, [lambda: runner.stream_context, lambda: runner.stream_context]) == runner.streams
    assert runner.stream_context is runner.streams[0]     # binding another thread left this one on stream 0
    for stream in (-1, 2):
        with pytest.raises(InvalidArgument, match="stream"):
            runner.bind_stream(stream)


def test_each_stream_replays_its_own_graphs(engine):
    runner = engine.runner
    first, second = (ctx.graphs for ctx in runner.streams)
    assert first is not second and first.batch_sizes == second.batch_sizes == GRAPH_SIZES
    before = (first.replays, second.replays)
    prompts = random_prompts(30, [7, 12], seed=3)

    def decode_on_second_stream():
        runner.bind_stream(1)
        return generate(engine, prompts)

    with ThreadPoolExecutor(1) as pool:
        on_second = pool.submit(decode_on_second_stream).result()
    assert (first.replays, second.replays) == (before[0], before[1] + STEPS)
    assert_same(on_second, generate(engine, prompts))     # the same sequences again, on stream 0
    assert (first.replays, second.replays) == (before[0] + STEPS, before[1] + STEPS)
