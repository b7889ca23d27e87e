"""M2M100 (NLLB's architecture) on the CPU backend against transformers on the same tiny random checkpoint: the
encoder and the teacher-forced decoder's logits, a gateway's own Prefill/Decode loop, and beam search
(BeamGenerate) over batched requests of different source lengths, decoder prefixes, beam counts, length
penalties and early_stopping modes."""

import collections
import itertools

import pytest
import torch
from safetensors.torch import load_file

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.beam.params import BeamParams, BeamRequest
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import FailedPrecondition, InvalidArgument, OutOfKvBlocks, OutOfRange
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sequence import BlockTable
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from beam_reference import (FILL, LogitsRecorder, assert_same, check_search, reference_hypotheses,
                            round_logits_to_bf16)
from gateway_loop import forced_then_greedy
from tiny_models import load_m2m100_reference, write_tiny_m2m100

SOURCES = [[5, 17, 99, 3, 42, 2], [7, 8, 150, 33, 61, 90, 14, 77, 101, 12, 2], [250, 2], [4, 66, 31] * 6 + [2]]
START = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = write_tiny_m2m100(tmp_path_factory.mktemp("m2m100") / "m2m100")
    engine, info = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=400,
                                                                         kv_block_size=4))
    reference = load_m2m100_reference(directory)
    # A second EOS id that greedy search emits often, so hypotheses finish early.
    greedy = reference.generate(torch.tensor([SOURCES[0]]), decoder_input_ids=torch.tensor([[START]]),
                                max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=FILL,
                                decoder_start_token_id=START)[0, 1:].tolist()
    eos = (2, collections.Counter(greedy).most_common(1)[0][0])
    return engine, info, reference, eos


def test_logits_match_transformers(models):
    engine, info, reference, _ = models
    assert info.architecture == "M2M100ForConditionalGeneration"
    decoder = [[START, 33, 61, 90, 14], [START, 44], [START, 9, 9, 1, 7]]   # a padding id (1) among them too
    size, free = engine.config.kv_block_size, iter(range(engine.cache.blocks.num_blocks))
    cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in SOURCES[:3]]
    engine.model.encode(build_batch([Segment(t, 0, s, False) for t, s in zip(cross, SOURCES)], size),
                        engine.cache.layers)
    segments = [Segment(BlockTable([next(free), next(free)]), 0, tokens, True, (table, len(source)))
                for tokens, table, source in zip(decoder, cross, SOURCES)]
    batch = build_batch(segments, size)
    batch.sample_rows = torch.arange(batch.num_tokens)         # every row's logits, not only the last
    ours = engine.forwards.forward(batch)
    with torch.no_grad():
        expected = torch.cat([reference(input_ids=torch.tensor([s]), decoder_input_ids=torch.tensor([d])).logits[0]
                              for s, d in zip(SOURCES, decoder)])
    assert torch.isfinite(ours).all()
    assert (ours - expected).norm() / expected.norm() < 1e-5


def test_sources_with_padding_ids_encode_as_transformers(models):
    """transformers counts a source's positions past its padding ids (1) only: such a batch takes its positions
    from the host, the others from the device metadata (which a CUDA graph can replay)."""
    engine, _, reference, _ = models
    sources = [[5, 1, 17, 99, 2], [1, 1, 8, 2], [250, 2]]
    decoder = [[START, 33, 61], [START, 44], [START, 9]]
    size, free = engine.config.kv_block_size, iter(range(engine.cache.blocks.num_blocks))
    cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in sources]
    for group in ([0, 1], [2]):     # with padding ids; without
        engine.model.encode(build_batch([Segment(cross[i], 0, sources[i], False) for i in group], size),
                            engine.cache.layers)
    segments = [Segment(BlockTable([next(free)]), 0, tokens, True, (table, len(source)))
                for tokens, table, source in zip(decoder, cross, sources)]
    batch = build_batch(segments, size)
    batch.sample_rows = torch.arange(batch.num_tokens)
    ours = engine.forwards.forward(batch)
    with torch.no_grad():
        expected = torch.cat([reference(input_ids=torch.tensor([s]), decoder_input_ids=torch.tensor([d])).logits[0]
                              for s, d in zip(sources, decoder)])
    assert (ours - expected).norm() / expected.norm() < 1e-5


@pytest.mark.parametrize("length_penalty, early_stopping", list(itertools.product((0.0, 1.0, 2.0),
                                                                                  (True, False, "never"))))
def test_beam_search_matches_transformers(models, length_penalty, early_stopping):
    engine, _, reference, eos = models
    free = engine.cache.blocks.num_free
    requests = []
    for i, (source, beams, prefix) in enumerate(zip(SOURCES * 2, (1, 2, 4, 5, 5, 4, 2, 1),
                                                    ((), (200,), (), (201, 5)) * 2)):
        params = BeamParams(num_beams=beams, max_new_tokens=5 + 3 * i, min_new_tokens=i % 3,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            no_repeat_ngram_size=3 * (i % 2), num_return_sequences=max(1, beams - i % 2))
        requests.append(BeamRequest(i, src_tokens=tuple(source), decoder_prefix=prefix, params=params))
    results = engine.beam_generate(requests, eos, FILL)
    for request, result in zip(requests, results):
        expected = reference_hypotheses(reference, [START, *request.decoder_prefix], request.params, eos,
                                        source=list(request.src_tokens))
        assert_same(result.hypotheses, expected)
    assert engine.cache.blocks.num_free == free


def generate_prefixed(engine, reference, eos, prefixes) -> None:
    """A call of one request per decoder prefix (SOURCES in turn, 2, 3, .. beams), each as transformers' generate."""
    requests = [BeamRequest(i, src_tokens=tuple(source), decoder_prefix=prefix,
                            params=BeamParams(num_beams=2 + i, max_new_tokens=6, num_return_sequences=2))
                for i, (source, prefix) in enumerate(zip(SOURCES, prefixes))]
    for request, result in zip(requests, engine.beam_generate(requests, eos, FILL)):
        expected = reference_hypotheses(reference, [START, *request.decoder_prefix], request.params, eos,
                                        source=list(request.src_tokens))
        assert_same(result.hypotheses, expected)


def test_short_prompts_a_token_a_forward_match_transformers(models, monkeypatch):
    """Where decode forwards replay graphs, NLLB-style prompts (start token and a prefix) run a token a forward; a
    prompt holding the padding id (1), whose later positions transformers counts past it, runs in one forward.
    Both as transformers' generate; NLLB's case, every prompt two tokens long, runs the first token's forward with
    no candidates (no prompt ends there)."""
    engine, _, reference, eos = models
    monkeypatch.setattr(engine.runner, "decode_graph_rows", 256)
    query_lens, forward = [], engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda batch, kv: query_lens.append(max(batch.query_lens))
                        or forward(batch, kv))
    counts, beam_forward = [], engine.forwards.beam_forward
    monkeypatch.setattr(engine.forwards, "beam_forward", lambda batch, banned, count: counts.append(count)
                        or beam_forward(batch, banned, count))
    free = engine.cache.blocks.num_free
    for prefixes, longest, alone in ((((200,), (), (201, 5)), 1, 0), (((200,), (201,), (5,)), 1, 1),
                                     (((1, 7), (200,)), 3, 0)):
        query_lens.clear()
        counts.clear()
        generate_prefixed(engine, reference, eos, prefixes)
        assert max(query_lens) == longest
        assert counts.count(0) == alone         # forwards run for their KV alone: no candidates taken
    assert engine.cache.blocks.num_free == free


@pytest.mark.parametrize("length_penalty, early_stopping", [(0.0, True), (1.0, False), (2.0, "never")])
@pytest.mark.parametrize("rounded", [False, True])
def test_the_search_is_transformers_search_over_our_logits(models, monkeypatch, length_penalty, early_stopping,
                                                           rounded):
    """The logits each of our forwards computed, recorded by prefix (LogitsRecorder) and replayed through
    transformers' generate, give every request our hypotheses. On the CPU those logits are transformers' own as
    well; on the GPU the same check separates the search from bf16 rounding (test_cuda_beam.py). rounded: the
    logits rounded to bf16 first (round_logits_to_bf16), whose ties the search must break as the replay does."""
    engine, _, reference, eos = models
    if rounded:
        round_logits_to_bf16(engine, monkeypatch)
    requests = [BeamRequest(i, src_tokens=tuple(source), decoder_prefix=((), (200,), (201, 5))[i % 3],
                            params=BeamParams(num_beams=beams, max_new_tokens=6 + 2 * i, min_new_tokens=i % 3,
                                              length_penalty=length_penalty, early_stopping=early_stopping,
                                              no_repeat_ngram_size=3 * (i % 2),
                                              num_return_sequences=max(1, beams - i % 2)))
                for i, (source, beams) in enumerate(zip(SOURCES * 2, (1, 2, 4, 5, 5, 4, 2, 1)))]
    with LogitsRecorder(engine) as recorder:
        results = engine.beam_generate(requests, eos, FILL)
    for i, (request, result) in enumerate(zip(requests, results)):
        check_search(result.hypotheses, reference, recorder, i, [START, *request.decoder_prefix], request.params,
                     eos, source=list(request.src_tokens))


def test_prompts_go_in_one_forward_where_the_backend_replays_prefill_graphs(models, monkeypatch):
    """Where the runner replays prefill graphs (Runner.prefill_graphs), NLLB-style prompts run in one replayable
    forward even where decode steps replay graphs too; a prompt holding the padding id runs in one forward that is
    not replayable (its positions are counted on the host). Both as transformers' generate."""
    engine, _, reference, eos = models
    runner = engine.runner
    monkeypatch.setattr(runner, "decode_graph_rows", 256)
    monkeypatch.setattr(runner, "prefill_graphs", True)
    prefills, run_forward = [], runner.run_forward

    def recording(forward, batch, replayable):
        if replayable and any(n != 1 for n in batch.query_lens):
            prefills.append(list(batch.query_lens))
        return run_forward(forward, batch, replayable)

    monkeypatch.setattr(runner, "run_forward", recording)
    free = engine.cache.blocks.num_free
    for prefixes, expected_prefills in ((((200,), (), (201, 5)), [[2, 1, 3]]), (((1, 7), (200,)), [])):
        prefills.clear()
        generate_prefixed(engine, reference, eos, prefixes)
        assert prefills == expected_prefills
    assert engine.cache.blocks.num_free == free


def test_prefill_and_decode_follow_transformers(models):
    """The gateway's own loop: Prefill the source (the encoder runs; the decoder starts from its start token),
    then Decode a forced target-language token and the greedy tokens after it, two sequences batched, each
    step's logits against transformers' decoder over the same tokens."""
    engine, _, reference, _ = models
    sources = {1: SOURCES[1], 2: SOURCES[2]}
    decoded, rows, next_tokens = forced_then_greedy(engine, sources, {1: 200, 2: 201}, 6, START)
    for i, source in sources.items():
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([source]),
                                 decoder_input_ids=torch.tensor([decoded[i]])).logits[0]
        ours = torch.stack(rows[i])
        assert (ours - expected).norm() / expected.norm() < 1e-5
        assert [int(t) for t in ours[1:].argmax(-1)] == decoded[i][2:] + [next_tokens[i]]
    engine.release(list(sources))
    assert engine.cache.blocks.num_free == engine.cache.blocks.num_blocks


@pytest.mark.parametrize("slice_, error", [
    (PrefillSlice(1, (5, 6, 2), is_last_chunk=False), FailedPrecondition),
    (PrefillSlice(1, (5, 6, 2), chunk_size=2), FailedPrecondition),
    (PrefillSlice(1, (5,) * 129), OutOfRange),
])
def test_a_source_comes_whole_and_fits_the_encoder(models, slice_, error):
    engine, _, _, _ = models
    with pytest.raises(error):
        engine.step(Step(prefill=(slice_,)))
    assert len(engine.sequences) == 0 and engine.cache.blocks.num_free == engine.cache.blocks.num_blocks


def test_a_pytorch_model_bin_loads_as_the_safetensors_do(tmp_path):
    """NLLB's checkpoints ship pytorch_model.bin: read with weights_only=True, and nothing but tensors."""
    source = write_tiny_m2m100(tmp_path / "safetensors")
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((source / "config.json").read_text())
    torch.save(load_file(str(source / "model.safetensors")), binary / "pytorch_model.bin")
    from_bin, from_safetensors = load_checkpoint(binary).tensors, load_checkpoint(source).tensors
    assert from_bin.keys() == from_safetensors.keys()
    assert all(torch.equal(from_bin[name], from_safetensors[name]) for name in from_bin)
    torch.save({"model.shared.weight": print}, binary / "pytorch_model.bin")
    with pytest.raises(InvalidArgument, match="weights_only"):
        load_checkpoint(binary)


def test_sources_short_of_blocks_change_nothing(models):
    """A source takes blocks for its cross-attention K/V: slices whose sources need more than the pool has are
    refused whole, and a live sequence decodes on as before."""
    engine, _, _, _ = models
    live = engine.step(Step(prefill=(PrefillSlice(1, tuple(SOURCES[0])),))).outputs[0].token
    free = engine.cache.blocks.num_free
    too_many = tuple(PrefillSlice(10 + i, (5,) * 128) for i in range(free // 32 + 1))   # 32 blocks of 4 each
    with pytest.raises(OutOfKvBlocks):
        engine.step(Step(prefill=too_many))
    assert engine.cache.blocks.num_free == free and set(engine.sequences.ids()) == {1}
    after = engine.step(Step(decode=(DecodeToken(1, live),))).outputs[0].token
    engine.release([1])
    engine.step(Step(prefill=(PrefillSlice(2, tuple(SOURCES[0])),)))
    assert engine.step(Step(decode=(DecodeToken(2, live),))).outputs[0].token == after
    engine.release([2])
    assert engine.cache.blocks.num_free == engine.cache.blocks.num_blocks
