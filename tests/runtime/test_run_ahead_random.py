"""Run-ahead under a random gateway: hypothesis draws a run of requests (prompts joining, decode steps over any
subset of the live sequences in any order, fed their sampled tokens or others, mixed steps, releases, forks) and
sends it to an engine that runs ahead (its guess chained, where the runner queues work, or run after the answer)
and to one that does not. Every answer must be the same, and so must every sequence's tokens, prefix-cache names,
free blocks and state slots at the end."""

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from metrale.runtime.errors import WorkerError  # noqa: E402
from metrale.runtime.sampling import OutputOptions, SamplingParams  # noqa: E402
from metrale.runtime.step import DecodeToken, PrefillSlice, Step  # noqa: E402
# checkpoint: the chain's fixture, a Llama and a hybrid whose guesses also advance recurrent states into slots
from test_run_ahead_chain import Stream, checkpoint, engine_of, state  # noqa: E402,F401

SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=3),
             SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.2)]
MAX_LIVE = 6


def outputs(out) -> list[tuple]:
    """Each output's sequence, token and logprob (None where it asked for none: NaN equals nothing)."""
    return [(o.seq_id, o.token, None if math.isnan(o.logprob) else o.logprob) for o in out.outputs]


class Gateway:
    """The same requests to both engines; each answer compared, the sampled tokens kept as a gateway keeps them."""

    def __init__(self, ahead: Stream, plain: Stream):
        self.ahead, self.plain = ahead, plain
        self.tokens: dict[int, int] = {}        # live sequence -> its last sampled token
        self.next_id = 1

    def send(self, step: Step) -> None:
        results = []
        for stream in (self.ahead, self.plain):
            try:
                results.append(("ok", outputs(stream.step(step))))
            except WorkerError as error:        # refused or undone alike: the same error, nothing changed
                results.append(("error", type(error).__name__))
        assert results[0] == results[1], step
        if results[0][0] == "ok":
            self.tokens.update((seq_id, token) for seq_id, token, _ in results[0][1])

    def release(self, seq_ids: list[int]) -> None:
        for stream in (self.ahead, self.plain):
            stream.engine.release(seq_ids)
        for seq_id in seq_ids:
            self.tokens.pop(seq_id, None)

    def fork(self, parent: int) -> None:
        child = self.next_id
        self.next_id += 1
        results = []
        for stream in (self.ahead, self.plain):
            try:
                stream.engine.fork(parent, [child])
                results.append("ok")
            except WorkerError as error:
                results.append(type(error).__name__)
        assert results[0] == results[1]
        if results[0] == "ok":
            self.tokens[child] = self.tokens[parent]


def prompt(seq_id: int, length: int) -> tuple[int, ...]:
    return tuple((seq_id * 13 + j * 7) % 200 + 3 for j in range(length))


def run(gateway: Gateway, data) -> None:
    for _ in range(data.draw(st.integers(4, 24), label="requests")):
        live = list(gateway.tokens)
        kind = data.draw(st.sampled_from(["prefill", "decode", "decode", "decode", "mixed", "release", "fork"]
                                         if live else ["prefill"]), label="kind")
        if kind in ("prefill", "mixed") and len(live) < MAX_LIVE:
            seq_id = gateway.next_id
            gateway.next_id += 1
            sampling = data.draw(st.sampled_from(SAMPLINGS), label="sampling")
            new = (PrefillSlice(seq_id, prompt(seq_id, data.draw(st.integers(1, 20), label="prompt")),
                                sampling=sampling, output=OutputOptions(logprobs=seq_id % 3 == 0)),)
        else:
            new = ()
        if kind in ("decode", "mixed") and live:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True), label="decode")
            # mostly the sampled token (the guess is taken), sometimes another (it is undone)
            same = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)), label="same")
            decode = tuple(DecodeToken(i, gateway.tokens[i] if keep or i % 2 else (gateway.tokens[i] + 1) % 200)
                           for i, keep in zip(ids, same))
        else:
            decode = ()
        if kind == "release":
            gateway.release(data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True), label="release"))
        elif kind == "fork" and len(live) < MAX_LIVE:
            gateway.fork(data.draw(st.sampled_from(live), label="parent"))
        elif decode or new:
            gateway.send(Step(decode=decode, prefill=new))


@pytest.mark.parametrize("queues_work", [True, False])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_random_gateway_sees_the_same_answers_and_leaves_the_same_state(checkpoint, queues_work, data):
    ahead = Stream(engine_of(checkpoint, "on", 4, queues_work), SAMPLINGS[0])
    plain = Stream(engine_of(checkpoint, "off", 4), SAMPLINGS[0])
    gateway = Gateway(ahead, plain)
    run(gateway, data)
    assert state(ahead.engine) == state(plain.engine)
