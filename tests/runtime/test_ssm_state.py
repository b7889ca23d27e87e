"""What a state-space model's sequences hold beside their blocks: the tail split where a chunk ends for a snapshot,
the worker's own chunks ending there, NormalizeSsmStates settling a guess, and state slots that run out cleanly."""

import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import OutOfStateSlots, UnknownSequence
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.planner import Limits, plan_step
from metrale.runtime.sampling import OutputOptions, SamplingParams
from metrale.runtime.sequence import Sequence, SequenceTable
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import write_tiny


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    return {name: load_checkpoint(write_tiny(name, root / name)) for name in ("nemotron_h", "llama_tied")}


def engine_of(checkpoint, **config):
    return build_engine(checkpoint, EngineConfig(device="cpu", **{"kv_blocks": 64, **config}))[0]


@pytest.mark.parametrize("num_tokens, split", [(45, 32), (33, 32), (32, 16), (17, 16), (16, None), (1, None)])
def test_the_tail_split_is_the_last_block_boundary_strictly_inside(checkpoints, num_tokens, split):
    assert engine_of(checkpoints["nemotron_h"]).prefill_tail_split(num_tokens) == split
    assert engine_of(checkpoints["llama_tied"]).prefill_tail_split(num_tokens) is None


@pytest.mark.parametrize("chunk_start, length, chunk_size, lengths", [
    (0, 45, 20, [20, 12, 8, 5]),        # the tail split (32) ends a chunk
    (0, 45, 16, [16, 16, 13]),          # it falls on a chunk end already
    (10, 35, 20, [20, 2, 13]),          # measured from the prompt's start, not the slice's
    (0, 16, 5, [5, 5, 5, 1]),           # no boundary strictly inside
])
def test_the_workers_own_chunks_end_at_the_tail_split(chunk_start, length, chunk_size, lengths):
    limits = Limits(max_model_len=512, max_batch_tokens=512, kv_block_size=16, max_seqs=8, splits_at_tail=True)
    sequences = SequenceTable()
    tokens = tuple(range(3, 3 + length))
    if chunk_start:
        sequences.add(Sequence(1, SamplingParams(), OutputOptions(), 0, tokens=list(range(chunk_start))))
    plan = plan_step(Step(prefill=(PrefillSlice(1, tokens, chunk_start=chunk_start, chunk_size=chunk_size),)),
                     sequences, 100, limits)
    assert [len(r[0].tokens) for r in plan.rounds] == lengths
    assert [r[0].start for r in plan.rounds] == [chunk_start + sum(lengths[:i]) for i in range(len(lengths))]
    assert [r[0].samples for r in plan.rounds] == [False] * (len(lengths) - 1) + [True]


def test_normalize_undoes_a_guess_and_changes_no_answer(checkpoints):
    ahead = engine_of(checkpoints["nemotron_h"], run_ahead="on")
    plain = engine_of(checkpoints["nemotron_h"], run_ahead="off")
    prompt = tuple(range(5, 30))
    def step(engine, step):
        """As a stream's thread drives the engine: the step, then its guess."""
        out = engine.step(step, run_ahead=True)
        if out.ahead is not None:
            out.ahead.run(lambda: None)
        return out

    sampled = dict(sampling=SamplingParams(seed=7), output=OutputOptions(logprobs=True))
    first = Step(prefill=(PrefillSlice(1, prompt, **sampled),))
    outs = [step(e, first) for e in (ahead, plain)]
    token = outs[1].outputs[0].token
    out = step(ahead, Step(decode=(DecodeToken(1, token),)))
    assert out.ahead is not None            # a guessed next step holds a state slot of sequence 1
    held = ahead.cache.states.num_free
    ahead.normalize_states([1])
    assert ahead.cache.states.num_free > held           # the guess's slot given back
    ahead.normalize_states([1])                         # idempotent
    token = plain.step(Step(decode=(DecodeToken(1, token),))).outputs[0].token
    assert ahead.cache.states.num_free == plain.cache.states.num_free
    for _ in range(4):          # the state a guess had advanced is the one before it again: the same tokens follow
        a, b = (engine.step(Step(decode=(DecodeToken(1, token),))).outputs[0] for engine in (ahead, plain))
        assert a.token == b.token and a.logprob == b.logprob
        token = a.token


def test_normalize_with_an_unknown_id_changes_nothing(checkpoints):
    engine = engine_of(checkpoints["nemotron_h"])
    engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)),)))
    free = engine.cache.states.num_free
    with pytest.raises(UnknownSequence):
        engine.normalize_states([1, 99])
    assert engine.cache.states.num_free == free and engine.live_seq_ids() == [1]


def test_a_step_that_cannot_get_state_slots_holds_nothing(checkpoints):
    """max_seqs=2: four slots, each held by one of four live sequences; a step on any of them finds none free."""
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2)
    engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)), PrefillSlice(2, (8, 9)))))
    engine.step(Step(prefill=(PrefillSlice(3, (5, 6, 7)), PrefillSlice(4, (8, 9)))))
    blocks, slots = engine.cache.blocks.num_free, engine.cache.states.num_free
    assert slots == 0
    with pytest.raises(OutOfStateSlots):
        engine.step(Step(decode=(DecodeToken(1, 4),), prefill=(PrefillSlice(5, (5, 6)),)))
    assert (engine.cache.blocks.num_free, engine.cache.states.num_free) == (blocks, slots)
    assert sorted(engine.live_seq_ids()) == [1, 2, 3, 4]
    engine.release([4])
    assert engine.step(Step(decode=(DecodeToken(1, 4),))).outputs[0].seq_id == 1


def test_forked_children_continue_from_a_copy_of_the_parents_state(checkpoints):
    """Each child gets the parent's state in a slot of its own: greedy children continue as the parent does, and
    one child's steps leave the parent's and its siblings' states as they were."""
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=4)
    logits = OutputOptions(return_logits=True)
    first = engine.step(Step(prefill=(PrefillSlice(1, tuple(range(5, 27)), output=logits),))).outputs[0].token
    free = engine.cache.states.num_free
    engine.fork(1, [2, 3])
    assert engine.cache.states.num_free == free - 2
    walked = engine.step(Step(decode=(DecodeToken(3, 9),)))          # child 3 goes elsewhere first
    assert walked.outputs[0].seq_id == 3
    outs = [engine.step(Step(decode=(DecodeToken(i, first),))).outputs[0] for i in (1, 2)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=0, atol=0)
    third = engine.step(Step(decode=(DecodeToken(3, first),))).outputs[0]
    assert not torch.equal(third.logits, outs[0].logits)              # its own state, advanced by its own token
    engine.release(None)
    assert engine.cache.states.num_free == engine.cache.states.num_slots


def test_a_fork_without_state_slots_changes_nothing(checkpoints):
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2)              # four slots
    engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)),)))
    before = (engine.cache.blocks.num_free, engine.cache.states.num_free, sorted(engine.live_seq_ids()))
    with pytest.raises(OutOfStateSlots):
        engine.fork(1, [2, 3, 4, 5])
    assert (engine.cache.blocks.num_free, engine.cache.states.num_free, sorted(engine.live_seq_ids())) == before
    engine.fork(1, [2, 3, 4])
    assert engine.cache.states.num_free == 0
