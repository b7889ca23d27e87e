"""The prefix cache through the engine: prompts that start with committed full blocks reuse them, and every family
gives the same tokens (and logits within float tolerance) with the cache on as off, against transformers too;
eviction under pressure, undone steps and releases never change a result nor lose a block."""

import pytest
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import OutOfKvBlocks, StepFailed
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sampling import OutputOptions, SamplingParams
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import TINY, TINY_MLA, TINY_SPARSE, load_reference, write_tiny

BLOCK = 16
LOGITS = OutputOptions(return_logits=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def engines(directory, **config):
    """The same checkpoint with the prefix cache on and off."""
    checkpoint = load_checkpoint(directory)
    return tuple(build_engine(checkpoint, EngineConfig(device="cpu", kv_block_size=BLOCK, prefix_cache=on,
                                                       **config))[0] for on in (True, False))


def prompt_of(length: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(engine, seq_id, prompt, steps=4, sampling=SamplingParams(), chunk_size=0, salt=""):
    """Prefill then `steps` decodes: the tokens, each output's logits, and the prompt tokens served from cache."""
    out = engine.step(Step(prefill=(PrefillSlice(seq_id, tuple(prompt), chunk_size=chunk_size, sampling=sampling,
                                                 output=LOGITS, cache_salt=salt),)))
    cached = out.outputs[0].cached_tokens
    tokens, logits = [out.outputs[0].token], [out.outputs[0].logits]
    for _ in range(steps):
        out = engine.step(Step(decode=(DecodeToken(seq_id, tokens[-1]),)))
        tokens.append(out.outputs[0].token)
        logits.append(out.outputs[0].logits)
    return tokens, logits, cached


def assert_same(a, b):
    tokens_a, logits_a, _ = a
    tokens_b, logits_b, _ = b
    assert tokens_a == tokens_b
    for x, y in zip(logits_a, logits_b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(TINY) + sorted(TINY_MLA) + sorted(TINY_SPARSE))
def test_a_shared_prefix_is_reused_and_changes_no_token(name, tmp_path):
    directory = write_tiny(name, tmp_path / name)
    cached, plain = engines(directory, kv_blocks=64)
    system = prompt_of(2 * BLOCK + 5, 1)
    for i, question in enumerate((prompt_of(9, 2), prompt_of(23, 3), prompt_of(1, 4))):
        for sampling in (SamplingParams(), SEEDED):
            seq_id = 10 * i + (sampling is SEEDED)
            ours = generate(cached, seq_id, system + question, sampling=sampling)
            assert_same(ours, generate(plain, seq_id, system + question, sampling=sampling))
            # the first prompt computes the system prompt's two full blocks, every later question takes them, and
            # the same prompt again takes each of its full blocks but the one holding its last token
            whole = (len(system + question) - 1) // BLOCK * BLOCK
            assert ours[2] == (0 if seq_id == 0 else whole if sampling is SEEDED else 2 * BLOCK)
            assert generate(plain, seq_id + 100, system + question)[2] == 0
    reference = load_reference(directory)
    prompt = system + prompt_of(9, 2)
    tokens, logits, served = generate(cached, 99, prompt, steps=2)
    assert served == 2 * BLOCK
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens[:2]])).logits[0, len(prompt) - 1:]
    for ours, want in zip(logits, expected):
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-4


def test_every_chunking_and_a_mixed_step_give_the_same_tokens(tmp_path):
    cached, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=64)
    system = prompt_of(3 * BLOCK, 5)
    generate(cached, 1, system + [3])           # the cache now holds the system prompt's blocks
    expected = generate(plain, 1, system + [9, 8, 7, 6, 5])
    for seq_id, chunk_size in ((2, 0), (3, 1), (4, 5), (5, 17)):
        ours = generate(cached, seq_id, system + [9, 8, 7, 6, 5], chunk_size=chunk_size)
        assert ours[2] == 3 * BLOCK
        assert_same(ours, expected)
    # a prompt in two calls: the second starts past the cached blocks as any continuation does
    first = cached.step(Step(prefill=(PrefillSlice(6, tuple(system[:40]), is_last_chunk=False, output=LOGITS),)))
    assert first.outputs == []
    out = cached.step(Step(decode=(DecodeToken(1, 4),),
                           prefill=(PrefillSlice(6, tuple(system[40:] + [9, 8, 7, 6, 5]), chunk_start=40,
                                                 output=LOGITS),)))
    assert out.outputs[1].token == expected[0][0]
    torch.testing.assert_close(out.outputs[1].logits, expected[1][0], rtol=1e-4, atol=1e-4)


def test_eviction_under_pressure_never_changes_a_result(tmp_path):
    """A pool of 12 blocks: cached prefixes are evicted (least recently freed first) for new prompts, which then
    run exactly as without the cache; free_kv_blocks counts the cached blocks, and nothing is refused for them."""
    cached, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=12, max_model_len=192)
    counts = cached.prefix_counts
    for round_ in range(3):
        for i in range(4):
            # 3 blocks each while running, 2 of them cached after: round 1 evicts round 0's, round 2 reuses round 1's
            prompt = prompt_of(2 * BLOCK + 3, 20 + 4 * min(round_, 1) + i)
            seq_id = 100 * round_ + i
            assert_same(generate(cached, seq_id, prompt, steps=2), generate(plain, seq_id, prompt, steps=2))
            cached.release([seq_id])
            plain.release([seq_id])
        stats = cached.stats()
        assert stats.free_kv_blocks == stats.num_kv_blocks and stats.live_sequences == 0
        assert stats.cached_kv_blocks > 0
    assert counts.hits > 0 and counts.evictions > 0
    # one prompt needing every block: the cache gives all of its blocks up
    long = prompt_of(12 * BLOCK - 1, 30)
    assert_same(generate(cached, 999, long, steps=0), generate(plain, 999, long, steps=0))
    with pytest.raises(OutOfKvBlocks):      # and one block past the pool is refused, with nothing held
        cached.step(Step(prefill=(PrefillSlice(1000, tuple(prompt_of(BLOCK, 31))),)))
    assert sorted(cached.sequences.ids()) == [999]


def test_a_released_sharer_leaves_the_blocks_another_holds(tmp_path):
    cached, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=10, max_model_len=160)
    system = prompt_of(2 * BLOCK, 8)
    a = generate(cached, 1, system + [5, 6], steps=1)
    b_first = cached.step(Step(prefill=(PrefillSlice(2, tuple(system + [7]), output=LOGITS),)))
    assert b_first.outputs[0].cached_tokens == 2 * BLOCK
    cached.release([1])         # the shared blocks stay held by 2
    filler = prompt_of(6 * BLOCK, 9)       # takes every block not held: evicts what only the cache held
    generate(cached, 3, filler, steps=0)
    expected = generate(plain, 2, system + [7], steps=3)
    assert b_first.outputs[0].token == expected[0][0]
    token = b_first.outputs[0].token
    for want_token, want_logits in zip(expected[0][1:], expected[1][1:]):
        out = cached.step(Step(decode=(DecodeToken(2, token),)))
        token = out.outputs[0].token
        assert token == want_token
        torch.testing.assert_close(out.outputs[0].logits, want_logits, rtol=1e-4, atol=1e-4)
    assert a[2] == 0


def test_match_prefix_is_read_only_and_salts_keep_chains_apart(tmp_path):
    cached, _ = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=32)
    system = prompt_of(2 * BLOCK + 4, 10)
    assert cached.match_prefix(system) == 0
    generate(cached, 1, system, steps=0, salt="tenant a")
    free = cached.stats()
    assert cached.match_prefix(system + [1], "tenant a") == 2 * BLOCK
    assert cached.match_prefix(system[:2 * BLOCK], "tenant a") == BLOCK       # the last token is always computed
    assert cached.match_prefix(system + [1]) == 0 and cached.match_prefix(system + [1], "tenant b") == 0
    assert cached.stats() == free and cached.prefix_counts.hits == 0
    assert generate(cached, 2, system + [1], steps=0, salt="tenant b")[2] == 0
    assert generate(cached, 3, system + [1], steps=0, salt="tenant a")[2] == 2 * BLOCK


def test_an_undone_step_gives_its_cached_blocks_back(tmp_path):
    cached, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=16)
    system = prompt_of(2 * BLOCK + 1, 11)
    generate(cached, 1, system, steps=0)
    cached.release([1])
    before = cached.stats()

    def failing(output):
        raise RuntimeError("an answer that cannot be built")

    with pytest.raises(StepFailed):
        cached.step(Step(prefill=(PrefillSlice(2, tuple(system + [4]), output=LOGITS),)), reply=failing)
    assert cached.stats() == before
    assert_same(generate(cached, 2, system + [4], steps=2), generate(plain, 2, system + [4], steps=2))


def test_the_cache_off_keeps_nothing(tmp_path):
    _, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=16)
    system = prompt_of(3 * BLOCK, 12)
    generate(plain, 1, system, steps=0)
    plain.release([1])
    assert plain.match_prefix(system) == 0 and plain.stats().cached_kv_blocks == 0 and plain.prefix_counts is None


@pytest.mark.parametrize("name", ["llama_tied", "deepseek_v2_lite"])
def test_forked_children_continue_the_parent_as_fresh_sequences_would(name, tmp_path):
    """Fork after a prompt of 2 blocks and 5 tokens: each child shares the 2 full blocks and has the partial one
    copied (K/V, or a latent cache); greedy children follow the parent's own continuation, a seeded child samples
    as a fresh sequence with the child's seed fed the same tokens does, and children of one parent sample apart."""
    from metrale.runtime.forks import child_seed

    cached, plain = engines(write_tiny(name, tmp_path / name), kv_blocks=40)
    prompt = prompt_of(2 * BLOCK + 5, 13)
    for engine in (cached, plain):
        free = engine.stats().free_kv_blocks
        greedy, _, _ = generate(engine, 1, prompt, steps=0)
        assert engine.fork(1, [11, 12]).blocks_shared == 2
        assert engine.stats().free_kv_blocks == free - 3 - 2          # the parent's 3, one copied block a child
        outs = [engine.step(Step(decode=(DecodeToken(i, greedy[0]),))) for i in (1, 11, 12)]
        assert len({o.outputs[0].token for o in outs}) == 1
        for o in outs[1:]:
            torch.testing.assert_close(o.outputs[0].logits, outs[0].outputs[0].logits, rtol=1e-5, atol=1e-5)
        engine.release(None)
        assert engine.stats().free_kv_blocks == free
    seeded = SamplingParams(temperature=1.0, seed=5)
    parent = cached.step(Step(prefill=(PrefillSlice(1, tuple(prompt), sampling=seeded),))).outputs[0].token
    cached.fork(1, [21, 22, 23])
    children = {}
    for child in (21, 22, 23):
        token, tokens = parent, []
        for _ in range(6):
            token = cached.step(Step(decode=(DecodeToken(child, token),))).outputs[0].token
            tokens.append(token)
        children[child] = tokens
    assert len({tuple(t) for t in children.values()}) > 1
    fresh_seed = SamplingParams(temperature=1.0, seed=child_seed(5, 22))
    plain.step(Step(prefill=(PrefillSlice(30, tuple(prompt), sampling=fresh_seed),)))
    token, tokens = parent, []
    for _ in range(6):
        token = plain.step(Step(decode=(DecodeToken(30, token),))).outputs[0].token
        tokens.append(token)
    assert tokens == children[22]


def test_a_bad_fork_changes_nothing(tmp_path):
    from metrale.runtime.errors import FailedPrecondition, InvalidArgument, UnknownSequence

    cached, _ = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=6, max_model_len=96)
    generate(cached, 1, prompt_of(BLOCK + 3, 14), steps=0)            # 2 blocks, the last partly filled
    cached.step(Step(prefill=(PrefillSlice(2, tuple(prompt_of(5, 15)), is_last_chunk=False),)))
    before = (cached.stats(), sorted(cached.sequences.ids()))
    for parent, children, error in ((9, [10], UnknownSequence), (1, [], InvalidArgument),
                                    (1, [10, 10], InvalidArgument), (1, [1], InvalidArgument),
                                    (1, [2], InvalidArgument), (2, [10], FailedPrecondition),
                                    (1, [10, 11, 12, 13, 14], OutOfKvBlocks)):    # 5 copies, 3 blocks free
        with pytest.raises(error):
            cached.fork(parent, children)
        assert (cached.stats(), sorted(cached.sequences.ids())) == before
    cached.fork(1, [10, 11, 12])
    assert cached.stats().free_kv_blocks == 0


def test_beam_search_takes_the_blocks_the_cache_holds_and_finds_the_same_beams(tmp_path):
    """Beam search reserves its worst case from the pool: with the cache holding most of the pool it evicts as it
    needs, and its hypotheses are those of the cache-off engine."""
    from metrale.runtime.beam.params import BeamParams, BeamRequest

    cached, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=24, max_model_len=96)
    for seq_id in range(5):                 # 4 cached blocks each: 20 of the 24 only the cache holds
        generate(cached, seq_id, prompt_of(4 * BLOCK + 2, 40 + seq_id), steps=0)
        cached.release([seq_id])
    assert cached.stats().cached_kv_blocks == 20
    requests = [BeamRequest(i, prompt_tokens=tuple(prompt_of(20, 50 + i)),
                            params=BeamParams(num_beams=3, max_new_tokens=6, num_return_sequences=2))
                for i in range(2)]
    ours = cached.beam_generate(requests, (2,), 0)
    assert cached.prefix_counts.evictions > 0
    theirs = plain.beam_generate(requests, (2,), 0)
    assert [r.hypotheses for r in ours] == [r.hypotheses for r in theirs]
    assert cached.stats().free_kv_blocks == cached.stats().num_kv_blocks


def test_run_ahead_guesses_on_sequences_that_share_cached_blocks(tmp_path):
    """With run-ahead on, guessed steps (taken and undone) on sequences holding shared blocks give what the
    cache-off engine gives, and leave every block accounted for."""
    cached, plain = engines(write_tiny("llama_tied", tmp_path / "llama"), kv_blocks=40, run_ahead="on")
    system = prompt_of(2 * BLOCK + 3, 60)

    def step(engine, s):
        out = engine.step(s, run_ahead=True)
        if out.ahead is not None:
            out.ahead.run(lambda: None)
        return out

    generate(cached, 9, system + [9], steps=0)          # the cache now holds the system prompt's blocks
    outs = {}
    for engine in (cached, plain):
        out = step(engine, Step(prefill=tuple(PrefillSlice(i, tuple(system + [i])) for i in (3, 4))))
        assert [o.cached_tokens for o in out.outputs] == ([2 * BLOCK] * 2 if engine is cached else [0, 0])
        tokens = {o.seq_id: o.token for o in out.outputs}
        history = []
        for round_ in range(6):
            ids = [3, 4] if round_ % 3 else [4]             # the guess for [3, 4] is undone when only 4 comes
            out = step(engine, Step(decode=tuple(DecodeToken(i, tokens[i]) for i in ids)))
            tokens.update({o.seq_id: o.token for o in out.outputs})
            history.append([(o.seq_id, o.token) for o in out.outputs])
        outs[engine is cached] = history
        engine.release(None)
        stats = engine.stats()
        assert stats.free_kv_blocks == stats.num_kv_blocks and stats.live_sequences == 0
    assert outs[True] == outs[False]
    assert cached.ahead_counts.taken > 0 and cached.ahead_counts.undone > 0
