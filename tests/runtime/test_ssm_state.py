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
    held = [e.cache.states.num_slots - e.cache.states.num_free for e in (ahead, plain)]
    assert held[0] == held[1]               # the sequence's slot alone, on both
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
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, prefix_cache=False)
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
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, prefix_cache=False)     # four slots
    engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)),)))
    before = (engine.cache.blocks.num_free, engine.cache.states.num_free, sorted(engine.live_seq_ids()))
    with pytest.raises(OutOfStateSlots):
        engine.fork(1, [2, 3, 4, 5])
    assert (engine.cache.blocks.num_free, engine.cache.states.num_free, sorted(engine.live_seq_ids())) == before
    engine.fork(1, [2, 3, 4])
    assert engine.cache.states.num_free == 0


def greedy_run(engine, seq_id: int, prompt, steps: int = 6):
    """The prompt's last logits and cached_tokens, then `steps` greedy tokens with their logits."""
    out = engine.step(Step(prefill=(PrefillSlice(seq_id, tuple(prompt), output=OutputOptions(return_logits=True)),)))
    first = out.outputs[0]
    rows, token = [first.logits], first.token
    tokens = []
    for _ in range(steps):
        o = engine.step(Step(decode=(DecodeToken(seq_id, token),))).outputs[0]
        rows.append(o.logits)
        tokens.append(token := o.token)
    return first.cached_tokens, rows, tokens


def test_a_prompt_resumes_from_the_snapshot_at_its_deepest_cached_block(checkpoints):
    """A 45-token prompt runs as 32 + 13 tokens (the tail split) and leaves the state after token 32 as a snapshot;
    a prompt sharing its first 40 tokens resumes there (32 cached) and continues as a cold engine does."""
    cached = engine_of(checkpoints["nemotron_h"])
    cold = engine_of(checkpoints["nemotron_h"], prefix_cache=False)
    first = list(range(5, 50))
    greedy_run(cached, 1, first, steps=0)
    assert cached.cache.states.num_snapshots == 1
    cached.release([1])
    second = first[:40] + list(range(100, 110))
    assert cached.match_prefix(second) == 32
    hit, rows, tokens = greedy_run(cached, 2, second)
    miss, want_rows, want_tokens = greedy_run(cold, 2, second)
    assert (hit, miss) == (32, 0) and tokens == want_tokens
    for a, b in zip(rows, want_rows):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    cached.release(None)
    assert cached.cache.states.num_free == cached.cache.states.num_slots       # snapshots count as free


def test_match_prefix_reports_only_prefixes_a_snapshot_resumes(checkpoints):
    """Blocks 0-2 of a 60-token prompt are cached but only the state after block 2 (its tail split, 48) is kept:
    a prompt sharing 40 tokens matches 2 cached blocks and can resume from neither."""
    engine = engine_of(checkpoints["nemotron_h"])
    prompt = list(range(5, 65))
    greedy_run(engine, 1, prompt, steps=0)
    assert engine.match_prefix(prompt[:50] + [7, 8]) == 48
    assert engine.match_prefix(prompt[:40] + [7, 8]) == 0
    llama = engine_of(checkpoints["llama_tied"])
    greedy_run(llama, 1, prompt, steps=0)
    assert llama.match_prefix(prompt[:40] + [7, 8]) == 32


def test_snapshots_are_kept_within_their_budget_least_recently_used_first(checkpoints):
    from metrale.runtime.cache.specs import slot_bytes

    probe = engine_of(checkpoints["nemotron_h"])
    engine = engine_of(checkpoints["nemotron_h"], ssm_snapshot_memory=2 * slot_bytes(probe.cache.specs))
    prompts = [list(range(5 + 50 * i, 5 + 50 * i + 20)) for i in range(3)]          # one snapshot each, at 16
    for seq_id, prompt in enumerate(prompts):
        greedy_run(engine, seq_id, prompt, steps=0)
    assert engine.cache.states.num_snapshots == 2
    assert [engine.match_prefix(p) for p in prompts] == [0, 16, 16]


def test_state_slots_take_at_most_half_the_cache_memory_of_a_hybrid(checkpoints, monkeypatch):
    """A machine whose cache share holds 10 slots' bytes: the hybrid gets 5 slots (half), not 2 x max_seqs."""
    from metrale.runtime.backend.cpu.runner import CpuRunner
    from metrale.runtime.cache.specs import slot_bytes

    per_slot = slot_bytes(engine_of(checkpoints["nemotron_h"]).cache.specs)
    monkeypatch.setattr(CpuRunner, "available_cache_bytes", lambda self, fraction: 10 * per_slot)
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=64)
    assert engine.cache.states.num_slots == 5


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_guess_and_its_successor_fit_beside_every_sequence_and_evict_no_snapshot(checkpoints, prefix_cache):
    """Run-ahead on: a third slot per sequence for a guess's successor; a guess takes only free slots."""
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, run_ahead="on", prefix_cache=prefix_cache)
    if prefix_cache:                        # two snapshots kept
        for seq_id in (10, 11):
            engine.step(Step(prefill=(PrefillSlice(seq_id, tuple(range(5 + seq_id, 40 + seq_id))),)))
            engine.release([seq_id])
    out = engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)), PrefillSlice(2, (8, 9)))))
    tokens = {o.seq_id: o.token for o in out.outputs}
    out = engine.step(Step(decode=tuple(DecodeToken(i, t) for i, t in tokens.items())), run_ahead=True)
    out.ahead.run(lambda: None)
    assert out.ahead.next is not None
    assert engine.cache.states.num_snapshots == (2 if prefix_cache else 0)


def test_snapshots_to_come_stay_within_the_budget_and_starve_no_step(checkpoints):
    """A prompt split into 7 block-ending chunks, in flight, takes at most max_snapshots (2) slots for its
    snapshots: a step on another stream still finds the slot it needs."""
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, ssm_snapshot_memory=2 * slot_size(checkpoints))
    engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)),)))
    plan, undo = engine._plan(Step(prefill=(PrefillSlice(2, tuple(range(100, 220)), chunk_size=16),)))
    assert sum(c.snapshot_slot >= 0 for chunks in plan.rounds for c in chunks) == 2
    engine.step(Step(decode=(DecodeToken(1, 4),)))
    with engine._lock:
        engine.reservations.restore(undo, plan)
    engine.release(None)
    assert engine.cache.states.num_free == engine.cache.states.num_slots


def test_fork_takes_back_the_slots_guesses_hold(checkpoints):
    """Six slots (max_seqs 2, run-ahead on): four live sequences and a guess with its successor hold them all."""
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, prefix_cache=False, run_ahead="on")
    engine.step(Step(prefill=(PrefillSlice(3, (5, 6)), PrefillSlice(4, (7, 8)))))
    out = engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)), PrefillSlice(2, (8, 9)))))
    token = {o.seq_id: o.token for o in out.outputs}[2]
    out = engine.step(Step(decode=(DecodeToken(2, token),)), run_ahead=True)
    out.ahead.run(lambda: None)
    assert engine.cache.states.num_free == 0
    engine.fork(1, [5])
    assert 5 in engine.live_seq_ids()


def test_no_snapshot_budget_takes_no_snapshot(checkpoints):
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, ssm_snapshot_memory=0)
    copies = []
    engine.forwards.copy_states = copies.append
    engine.step(Step(prefill=(PrefillSlice(1, tuple(range(5, 60)), chunk_size=8),)))
    assert copies == [] and engine.cache.states.num_snapshots == 0


def test_a_new_sequence_reads_zeros_whatever_a_freed_slot_holds(checkpoints):
    engine = engine_of(checkpoints["nemotron_h"], max_seqs=2, prefix_cache=False)
    engine.step(Step(prefill=(PrefillSlice(1, (5, 6, 7)),)))
    engine.release([1])
    for layer in engine.cache.layers:
        if isinstance(layer, tuple):
            for tensor in layer:
                tensor.fill_(float("nan"))
    out = engine.step(Step(prefill=(PrefillSlice(2, (5, 6, 7, 8), output=OutputOptions(return_logits=True)),)))
    assert torch.isfinite(out.outputs[0].logits).all()


def slot_size(checkpoints) -> int:
    from metrale.runtime.cache.specs import slot_bytes

    return slot_bytes(engine_of(checkpoints["nemotron_h"]).cache.specs)
