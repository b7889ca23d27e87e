"""The cache made of layer specs, through the engine: a toy model with one layer of each kind (paged K/V attention,
paged latent attention, a recurrent state, a feed-forward with no cache), in plain torch on the CPU, against the
same model recomputed over whole sequences without any cache. Reservation, release, sharing, exhaustion and undo
leave the block and state pools, and what Info reports of them, true."""

import math
from types import SimpleNamespace

import pytest
import torch

from metrale.runtime.backend.cpu import create_cpu_backend
from metrale.runtime.backend.layer_math import RopeTable
from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.cache.specs import NoCache, PagedKv, PagedLatent, RecurrentState, block_bytes, slot_bytes
from metrale.runtime.config import EngineConfig
from metrale.runtime.engine import Engine
from metrale.runtime.errors import OutOfKvBlocks, OutOfStateSlots, StepFailed
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step

VOCAB, HIDDEN, HEADS, HEAD_DIM, LATENT = 40, 16, 2, 8, 6
BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, MAX_LEN = 4, 14, 6, 64
LOGITS = OutputOptions(return_logits=True)


class ToyModel:
    """x = embed(tokens); then, each added to the residual: attention over paged K/V, attention over a paged latent
    vector per token (its keys and values projected from the latent), a decayed running sum whose state a sequence
    carries between forwards, and a ReLU feed-forward; logits of the sampled rows."""

    def __init__(self, math_ops):
        self.math = math_ops
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=MAX_LEN)
        g = torch.Generator().manual_seed(0)
        w = {name: torch.randn(*shape, generator=g) * 0.4 for name, shape in {
            "embed": (VOCAB, HIDDEN), "qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN),
            "latent": (LATENT, HIDDEN), "latent_q": (HIDDEN, HIDDEN), "latent_k": (HIDDEN, LATENT),
            "latent_v": (HIDDEN, LATENT), "state_in": (HIDDEN, HIDDEN), "up": (4 * HIDDEN, HIDDEN),
            "down": (HIDDEN, 4 * HIDDEN), "lm_head": (VOCAB, HIDDEN)}.items()}
        w["decay"] = torch.sigmoid(torch.randn(HIDDEN, generator=g))
        self.w = w
        half = HEAD_DIM // 2
        self.no_rope = RopeTable(torch.ones(MAX_LEN, half), torch.zeros(MAX_LEN, half), identity=True)

    def cache_specs(self):
        return PagedKv(HEADS, HEAD_DIM), PagedLatent(LATENT), RecurrentState(((HIDDEN,),)), NoCache()

    def replayable(self, batch) -> bool:
        return True

    def forward(self, batch, layers):
        w, ops = self.w, self.math
        meta = ops.prepare(batch)
        x = w["embed"][batch.token_ids]
        kv, latent, (state,), nothing = layers
        assert nothing is None
        q, k, v = (x @ w["qkv"].T).split(HIDDEN, dim=1)
        x = x + ops.self_attention(q, k, v, self.no_rope, meta, kv, HEADS, HEAD_DIM, HEAD_DIM ** -0.5, None) @ w["o"].T
        x = x + self._latent_attention(x, batch, latent)
        x = x + self._recurrence(x, batch, state)
        x = x + torch.relu(x @ w["up"].T) @ w["down"].T
        return x[batch.sample_rows] @ w["lm_head"].T

    def _latent_attention(self, x, batch, latent):
        flat = latent.view(-1, LATENT)
        flat[batch.slot_mapping] = x @ self.w["latent"].T
        out = torch.empty_like(x)
        for start, n, context, table in zip(batch.query_starts, batch.query_lens, batch.context_lens,
                                            batch.block_tables):
            cached = latent[torch.as_tensor(table, dtype=torch.int64)].reshape(-1, LATENT)[:context]
            out[start:start + n] = causal_attention(x[start:start + n], cached, self.w)
        return out

    def _recurrence(self, x, batch, state):
        out = torch.empty_like(x)
        for start, n, (source, destination) in zip(batch.query_starts, batch.query_lens, batch.state_slots):
            h = torch.zeros(HIDDEN) if source < 0 else state[source].clone()
            for row in range(start, start + n):
                h = self.w["decay"] * h + torch.tanh(x[row] @ self.w["state_in"].T)
                out[row] = h
            state[destination] = h
        return out

    def reference(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position of a whole sequence, no cache."""
        w, n = self.w, len(tokens)
        x = w["embed"][torch.tensor(tokens)]
        q, k, v = (x @ w["qkv"].T).split(HIDDEN, dim=1)
        heads = lambda t: t.view(n, HEADS, HEAD_DIM).transpose(0, 1)    # noqa: E731
        scores = heads(q) @ heads(k).transpose(1, 2) * HEAD_DIM ** -0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
        x = x + (torch.softmax(scores, -1) @ heads(v)).transpose(0, 1).reshape(n, HIDDEN) @ w["o"].T
        x = x + causal_attention(x, x @ w["latent"].T, w)
        h, rows = torch.zeros(HIDDEN), []
        for row in range(n):
            h = w["decay"] * h + torch.tanh(x[row] @ w["state_in"].T)
            rows.append(h)
        x = x + torch.stack(rows)
        x = x + torch.relu(x @ w["up"].T) @ w["down"].T
        return x @ w["lm_head"].T


def causal_attention(queries, latents, w):
    """The last len(queries) positions of a run attending to its latents [C, LATENT] (one head)."""
    n, context = queries.shape[0], latents.shape[0]
    scores = (queries @ w["latent_q"].T) @ (latents @ w["latent_k"].T).T / math.sqrt(HIDDEN)
    allowed = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
    return torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ (latents @ w["latent_v"].T)


@pytest.fixture
def toy():
    math_ops, runner = create_cpu_backend("float32")
    model = ToyModel(math_ops)
    specs = model.cache_specs()
    cache = CacheManager(specs, runner.allocate_cache(specs, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS), BLOCK_SIZE,
                         NUM_BLOCKS, NUM_SLOTS)
    engine = Engine(model, runner, cache, EngineConfig(device="cpu", kv_block_size=BLOCK_SIZE, max_seqs=4),
                    MAX_LEN)
    return model, engine


def prefill(seq_id, tokens, start=0, last=True, chunk_size=0):
    return PrefillSlice(seq_id, tuple(tokens), chunk_start=start, is_last_chunk=last, chunk_size=chunk_size,
                        output=LOGITS)


def held(engine) -> tuple[int, int, int, list[int]]:
    """Free blocks and slots, what Info reports as free, and the live sequences."""
    cache = engine.cache
    return cache.blocks.num_free, cache.states.num_free, engine.stats().free_kv_blocks, sorted(engine.sequences.ids())


def test_each_kind_of_layer_carries_its_cache_across_chunks_and_steps(toy):
    model, engine = toy
    prompts = {1: [3, 17, 5, 22, 9, 31, 2], 2: [8, 8, 1, 39, 14]}
    # seq 1's prompt over two calls (the second in chunks of 2), seq 2's in one, beside it
    engine.step(Step(prefill=(prefill(1, prompts[1][:3], last=False),)))
    out = engine.step(Step(prefill=(prefill(1, prompts[1][3:], start=3, chunk_size=2), prefill(2, prompts[2]))))
    tokens = {o.seq_id: list(prompts[o.seq_id]) for o in out.outputs}
    for o in out.outputs:
        torch.testing.assert_close(o.logits, model.reference(tokens[o.seq_id])[-1], rtol=1e-5, atol=1e-5)
    for _ in range(4):
        sampled = {o.seq_id: o.token for o in out.outputs}
        for seq_id, token in sampled.items():
            tokens[seq_id].append(token)
        out = engine.step(Step(decode=tuple(DecodeToken(i, t) for i, t in sampled.items())))
        for o in out.outputs:
            expected = model.reference(tokens[o.seq_id])[-1]
            torch.testing.assert_close(o.logits, expected, rtol=1e-5, atol=1e-5)
            assert o.token == int(expected.argmax())
    # two live sequences: one state slot each once their steps are done, and their blocks
    blocks = sum(-(-len(t) // BLOCK_SIZE) for t in tokens.values())
    assert held(engine) == (NUM_BLOCKS - blocks, NUM_SLOTS - 2, NUM_BLOCKS - blocks, [1, 2])
    assert engine.release(None).blocks_freed == blocks
    assert held(engine) == (NUM_BLOCKS, NUM_SLOTS, NUM_BLOCKS, [])


def test_a_step_undone_leaves_the_state_it_had(toy):
    """A step whose answer fails is undone: its sequence's state is the one before (the snapshot slot), so the
    same step again gives what an uninterrupted run gives."""
    model, engine = toy
    prompt = [4, 11, 27, 6, 19]
    out = engine.step(Step(prefill=(prefill(7, prompt),)))
    before = held(engine)
    token = out.outputs[0].token

    def failing(output):
        raise RuntimeError("an answer that cannot be built")

    with pytest.raises(StepFailed):
        engine.step(Step(decode=(DecodeToken(7, token),)), reply=failing)
    assert held(engine) == before
    other = engine.step(Step(prefill=(prefill(8, [2, 3]),)))      # takes the slot the undone step gave back
    again = engine.step(Step(decode=(DecodeToken(7, token),)))
    torch.testing.assert_close(again.outputs[0].logits, model.reference(prompt + [token])[-1], rtol=1e-5, atol=1e-5)
    again = engine.step(Step(decode=(DecodeToken(8, other.outputs[0].token),)))
    torch.testing.assert_close(again.outputs[0].logits, model.reference([2, 3, other.outputs[0].token])[-1],
                               rtol=1e-5, atol=1e-5)
    assert held(engine)[1] == NUM_SLOTS - 2


def test_exhaustion_of_either_pool_takes_nothing_from_the_other(toy):
    model, engine = toy
    for seq_id in range(1, 4):          # three live sequences: 3 slots and 3 blocks held
        engine.step(Step(prefill=(prefill(seq_id, [seq_id, 5, 6]),)))
    before = held(engine)
    assert before[:2] == (NUM_BLOCKS - 3, NUM_SLOTS - 3)
    # blocks short: a prompt one token longer than the free blocks hold
    with pytest.raises(OutOfKvBlocks):
        engine.step(Step(prefill=(prefill(9, [1] * (BLOCK_SIZE * (NUM_BLOCKS - 3) + 1)),)))
    assert held(engine) == before
    # slots short: three decode rows and a new prompt need 4 slots, 3 are free
    with pytest.raises(OutOfStateSlots):
        engine.step(Step(decode=tuple(DecodeToken(i, 1) for i in range(1, 4)), prefill=(prefill(9, [1, 2]),)))
    assert held(engine) == before
    engine.release([2])
    out = engine.step(Step(decode=(DecodeToken(1, 7), DecodeToken(3, 7)), prefill=(prefill(9, [1, 2]),)))
    for o, tokens in zip(out.outputs, ([1, 5, 6, 7], [3, 5, 6, 7], [1, 2])):
        torch.testing.assert_close(o.logits, model.reference(tokens)[-1], rtol=1e-5, atol=1e-5)
    assert held(engine)[1:] == (NUM_SLOTS - 3, NUM_BLOCKS - 3, [1, 3, 9])      # 4 tokens each fill one block


def test_shared_blocks_are_freed_by_their_last_holder_and_copies_reach_every_paged_layer(toy):
    _, engine = toy
    cache = engine.cache
    (block,), _ = cache.reserve(1, 0)
    cache.blocks.share([block])
    cache.free([block])
    assert cache.blocks.num_free == NUM_BLOCKS - 1
    cache.free([block])
    assert cache.blocks.num_free == NUM_BLOCKS
    kv, latent, (state,), _ = cache.layers
    kv[:, 2].normal_(), latent[2].normal_(), state.normal_()
    states = state.clone()
    engine.runner.copy_block_prefixes(cache.layers, [(2, 5, 3)])
    assert torch.equal(kv[:, 5, :3], kv[:, 2, :3]) and not kv[:, 5, 3:].any()
    assert torch.equal(latent[5, :3], latent[2, :3]) and not latent[5, 3:].any()
    assert torch.equal(state, states)


def test_the_pool_is_sized_by_the_specs():
    specs = ToyModel(None).cache_specs()
    # per token: K and V of 2 x 8, then 6 latent values; per slot: 16 float32
    assert block_bytes(specs, BLOCK_SIZE, 2) == BLOCK_SIZE * 2 * (2 * HEADS * HEAD_DIM + LATENT)
    assert slot_bytes(specs) == 4 * HIDDEN


def test_beam_search_takes_state_slots_with_its_blocks_and_gives_both_back(toy):
    """Two sets of num_beams state slots a request (the toy has 6 slots): 3 beams fit, 4 do not, and neither call
    leaves a block or slot held."""
    from metrale.runtime.beam.params import BeamParams, BeamRequest

    _, engine = toy
    free = engine.cache.blocks.num_free, engine.cache.states.num_free
    found = engine.beam_generate([BeamRequest(1, prompt_tokens=(3, 4, 5), params=BeamParams(
        num_beams=3, max_new_tokens=4))], (2,), 0)
    assert found[0].hypotheses and (engine.cache.blocks.num_free, engine.cache.states.num_free) == free
    with pytest.raises(OutOfStateSlots):
        engine.beam_generate([BeamRequest(1, prompt_tokens=(3, 4, 5), params=BeamParams(num_beams=4,
                                                                                      max_new_tokens=4))], (2,), 0)
    assert (engine.cache.blocks.num_free, engine.cache.states.num_free) == free
