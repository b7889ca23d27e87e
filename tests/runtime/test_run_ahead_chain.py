"""Chained guesses: while a guess runs, its successor is reserved; the request that takes the guess queues the
successor before its answer is built (where the runner queues work; the CPU's computes as it is called, so there
the stream runs the successor after the answer, as any guess). Every answer, block and prefix-cache name is the same
as without run-ahead, whether the successor is taken, undone by another request, or abandoned because the answer
could not be built; with one-token blocks too, where the successor's token fills a block of its own."""

import pytest

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import StepFailed
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sampling import SamplingParams
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import write_tiny

SAMPLING = SamplingParams(temperature=0.9, top_k=40, seed=3)
PENALISED = SamplingParams(temperature=0.9, top_k=40, seed=3, repetition_penalty=1.3, logit_bias=((5, 2.0),))
# (KV block size, sampling): the staged sampling rows, made before the tokens they follow, only without penalties.
CASES = [(16, SAMPLING), (1, SAMPLING), (16, PENALISED)]


@pytest.fixture(scope="module", params=["llama_tied", "nemotron_h"])
def checkpoint(request, tmp_path_factory):
    """A Llama, and a hybrid whose sequences also hold a recurrent state that a guess advances into a slot."""
    return load_checkpoint(write_tiny(request.param, tmp_path_factory.mktemp("chain") / request.param))


def engine_of(checkpoint, run_ahead: str, block: int, queues_work: bool = True):
    engine, _ = build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=24 * 16 // block, kv_block_size=block,
                                                      run_ahead=run_ahead, max_model_len=160))
    # The engine's order where the runner queues work (CUDA's), on the CPU's runner, which computes as it queues.
    engine.runner.queues_work = queues_work
    return engine


def pair(checkpoint, block: int, sampling, queues_work: bool = True) -> tuple["Stream", "Stream"]:
    """A stream on an engine that runs ahead and one on an engine that does not."""
    return (Stream(engine_of(checkpoint, "on", block, queues_work), sampling),
            Stream(engine_of(checkpoint, "off", block), sampling))


class Stream:
    """Drives an engine as a stream's thread does: the step, then (with run-ahead) its guess."""

    def __init__(self, engine, sampling):
        self.engine, self.sampling = engine, sampling

    def step(self, step: Step, reply=None):
        out = self.engine.step(step, run_ahead=True, reply=reply)
        if out.ahead is not None:
            out.ahead.run(lambda: None)
        return out

    def start(self, seq_ids, prompt_len=5):
        slices = tuple(PrefillSlice(i, tuple((i * 7 + j * 5) % 200 for j in range(prompt_len)),
                                    sampling=self.sampling) for i in seq_ids)
        return self.tokens(self.step(Step(prefill=slices)))

    def decode(self, tokens: dict, reply=None) -> dict:
        return self.tokens(self.step(Step(decode=tuple(DecodeToken(i, t) for i, t in tokens.items())), reply))

    @staticmethod
    def tokens(out) -> dict:
        return {o.seq_id: o.token for o in out.outputs}


def state(engine) -> tuple:
    """What must not differ from an engine that never runs ahead, once every guess is settled."""
    engine.guesses.settle(engine.sequences.ids())
    sequences = {i: list(engine.sequences.get(i).tokens) for i in engine.sequences.ids()}
    names = {i: list(engine.sequences.get(i).block_names) for i in engine.sequences.ids()}
    states = engine.cache.states            # slots held (an engine that runs ahead has more of them)
    return sequences, names, engine.cache.blocks.num_free, states.num_slots - states.num_free


@pytest.mark.parametrize("block, sampling", CASES)
@pytest.mark.parametrize("queues_work", [True, False])
def test_the_successor_runs_before_the_answer_and_changes_no_token(checkpoint, block, sampling, queues_work):
    chained, plain = pair(checkpoint, block, sampling, queues_work)
    tokens = chained.start([1, 2])
    assert tokens == plain.start([1, 2])
    held_at_reply = []

    def reply(out):     # the answer is built with the taken guess's successor already queued
        seq = chained.engine.sequences.get(1)
        held_at_reply.append(seq.num_tokens)
        return None

    for _ in range(40):                 # across two block boundaries: blocks taken and named under the chain
        expected = plain.decode(tokens)
        tokens = chained.decode(tokens, reply)
        assert tokens == expected
    # The first decode runs as a real step; from the second on, each request takes a guess and (where the runner
    # queues work) queues its successor, whose token the sequence holds while the answer is built.
    ahead = 1 if queues_work else 0
    assert held_at_reply[0] == 6 and held_at_reply[1:] == list(range(7 + ahead, 7 + ahead + 39))
    assert chained.engine.ahead_counts.taken == 39
    assert state(chained.engine) == state(plain.engine)


@pytest.mark.parametrize("block, sampling", CASES)
def test_another_request_undoes_the_guess_and_its_successor(checkpoint, block, sampling):
    chained, plain = pair(checkpoint, block, sampling)
    tokens = chained.start([1, 2, 3])
    plain.start([1, 2, 3])
    for _ in range(3):
        expected = plain.decode(tokens)
        tokens = chained.decode(tokens)
        assert tokens == expected
    assert chained.engine.stats().free_kv_blocks == plain.engine.stats().free_kv_blocks
    # Another token for one sequence: the pending guess, and the successor reserved while it ran, are undone.
    other = {i: (t + 1) % 200 for i, t in tokens.items()}
    assert chained.decode(other) == plain.decode(other)
    # One sequence dropped, then a release: the same again.
    fewer = {1: 11, 3: 13}
    assert chained.decode(fewer) == plain.decode(fewer)
    for engine in (chained.engine, plain.engine):
        engine.release([2])
    assert state(chained.engine) == state(plain.engine)


@pytest.mark.parametrize("block, sampling", CASES)
def test_an_answer_that_fails_undoes_the_step_and_its_queued_successor(checkpoint, block, sampling):
    chained, plain = pair(checkpoint, block, sampling)
    tokens = chained.start([1, 2])
    plain.start([1, 2])
    for _ in range(3):
        expected = plain.decode(tokens)
        tokens = chained.decode(tokens)
        assert tokens == expected
    taken = chained.engine.ahead_counts.taken

    def broken(out):
        raise ValueError("the answer could not be built")

    with pytest.raises(StepFailed):
        chained.decode(tokens, broken)
    assert chained.engine.ahead_counts.taken == taken + 1       # the guess was taken, its successor queued
    assert state(chained.engine) == state(plain.engine)         # and both undone
    # The same request again runs as a plain step would.
    assert chained.decode(tokens) == plain.decode(tokens)
    assert state(chained.engine) == state(plain.engine)
