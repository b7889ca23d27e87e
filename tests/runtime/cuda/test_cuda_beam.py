"""Beam search on the CUDA backend (bf16) against transformers on the GPU, same checkpoint: BeamGenerate on
M2M100 and on a decoder-only Llama, the search stepped on the device against the same search on the host, and a
device fault ending a call.

Beam search over bf16 logits follows transformers' float32 run token for token only where the rounding does not
decide it. The tests tell those requests apart without guessing at ties: our search runs on the host once more
with its logits recorded by prefix (beam_reference.LogitsRecorder), transformers' float32 generate is replayed
over those logits (replayed_hypotheses) and must give exactly our hypotheses; where that replay decides as
transformers does over its own float32 logits, ours must be transformers' hypotheses, scores within 1e-2. The
device search gives the host search's hypotheses exactly."""

import collections
import itertools

import pytest
import torch

from metrale.runtime.beam.params import BeamParams, BeamRequest
from beam_reference import FILL, LogitsRecorder, check_search, reference_hypotheses
from cuda_engines import SOURCES, START, WEIGHTS, engine_on_cuda
from tiny_models import write_tiny

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 150, 33, 61, 2, 90, 14, 77, 101, 12], [250], [4, 66, 31, 9, 180, 44, 71] * 3]
# Prompts short enough to run a token a forward (runner.SHORT_PROMPT), ending in different forwards.
SHORT_PROMPTS = [[5, 17], [7, 8, 150], [250], [4, 66, 31, 9]]


def beam_requests(inputs, encoder_decoder: bool, length_penalty, early_stopping, prefixes=((), (200,))
                  ) -> list[BeamRequest]:
    """prefixes: the encoder-decoder requests' decoder prefixes, taken in turn."""
    requests = []
    for i, (tokens, beams) in enumerate(zip(inputs * 2, (1, 2, 4, 5, 5, 4, 2, 1))):
        params = BeamParams(num_beams=beams, max_new_tokens=6 + 3 * i, min_new_tokens=i % 3,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            no_repeat_ngram_size=3 * (i % 2), num_return_sequences=max(1, beams - i % 2))
        if encoder_decoder:
            requests.append(BeamRequest(i, src_tokens=tuple(tokens), decoder_prefix=prefixes[i % len(prefixes)],
                                        params=params))
        else:
            requests.append(BeamRequest(i, prompt_tokens=tuple(tokens), params=params))
    return requests


def prompt_and_source(request: BeamRequest, encoder_decoder: bool) -> tuple[list[int], list[int] | None]:
    """What transformers' generate is given for the request: the decoder prompt, and the source (encoder-decoders)."""
    if encoder_decoder:
        return [START, *request.decoder_prefix], list(request.src_tokens)
    return list(request.prompt_tokens), None


def compare_beams(engine, reference, requests, eos, encoder_decoder: bool, monkeypatch) -> tuple[int, int]:
    """Ours (the device search) against the host search (the same hypotheses), the host search against
    transformers' float32 search over our logits (check_search), and against transformers' float32 hypotheses
    where that search decides as over float32 logits; returns (requests decided alike, requests in all)."""
    free = engine.cache.blocks.num_free
    on_device = engine.beam_generate(requests, eos, FILL)
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "device_search", lambda *args: None)
        with LogitsRecorder(engine) as recorder:
            on_host = engine.beam_generate(requests, eos, FILL)
    assert engine.cache.blocks.num_free == free
    decided = 0
    for i, (request, ours, host) in enumerate(zip(requests, on_device, on_host)):
        assert [t for t, _ in ours.hypotheses] == [t for t, _ in host.hypotheses], request.request_id
        assert torch.allclose(torch.tensor([s for _, s in ours.hypotheses]),
                              torch.tensor([s for _, s in host.hypotheses]), rtol=1e-6, atol=1e-6)
        prompt, source = prompt_and_source(request, encoder_decoder)
        replayed = check_search(host.hypotheses, reference, recorder, i, prompt, request.params, eos, source)
        expected = reference_hypotheses(reference, prompt, request.params, eos, source=source)
        if [t for t, _ in replayed] == [t for t, _ in expected]:
            decided += 1
            for (_, score), (_, want) in zip(ours.hypotheses, expected):
                assert abs(score - want) <= 1e-2 * max(1.0, abs(want)), (score, want)
    return decided, len(requests)


def frequent_token(reference, tokens, **inputs) -> int:
    """A second EOS id: the token greedy search emits most, so hypotheses finish early."""
    out = reference.generate(torch.tensor([tokens], device="cuda"), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=FILL, **inputs)[0, -24:].tolist()
    return collections.Counter(out).most_common(1)[0][0]


CASES = list(itertools.product((0.0, 1.0, 2.0), (True, False, "never")))


@pytest.mark.parametrize("length_penalty, early_stopping", CASES)
def test_m2m100_beam_search_follows_transformers(m2m100, monkeypatch, length_penalty, early_stopping):
    engine, _, reference, _ = m2m100
    eos = (2, frequent_token(reference, SOURCES[0], decoder_input_ids=torch.tensor([[START]], device="cuda"),
                             decoder_start_token_id=START))
    compared, total = compare_beams(engine, reference, beam_requests(SOURCES, True, length_penalty, early_stopping),
                                    eos, True, monkeypatch)
    print(f"m2m100 lp={length_penalty} early_stopping={early_stopping}: {compared}/{total} requests compared")
    assert compared >= total // 2


@pytest.mark.parametrize("length_penalty, early_stopping", CASES)
def test_llama_beam_search_follows_transformers(llama, monkeypatch, length_penalty, early_stopping):
    engine, _, reference, _ = llama
    eos = (2, frequent_token(reference, PROMPTS[0]))
    # distinct prompts (LogitsRecorder): beam_requests takes each input twice
    compared, total = compare_beams(engine, reference, beam_requests(PROMPTS, False, length_penalty,
                                                                     early_stopping)[:4], eos, False, monkeypatch)
    print(f"llama lp={length_penalty} early_stopping={early_stopping}: {compared}/{total} requests compared")
    assert compared >= total // 2


# (model, its inputs, the decoder prefixes taken in turn, whether the prompts all end in one forward)
SEARCHES = {"m2m100": ("m2m100", SOURCES, ((), (200,)), True),
            "m2m100-one-prefix": ("m2m100", SOURCES, ((200,),), True),
            "llama": ("llama", PROMPTS, (), True), "llama-short": ("llama", SHORT_PROMPTS, (), False)}


@pytest.mark.parametrize("case", SEARCHES)
@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (2.0, "never"), (0.0, True)])
def test_device_search_step_matches_the_host_step(request, monkeypatch, case, length_penalty, early_stopping):
    """The search stepped on the device (beam_step.cu) against the same search stepped on the host (BeamGroup) over
    the same engine: the same hypotheses, scores within float32 rounding; every block given back either way. The
    device search starts from the prompt pass's candidates where they are (beam_seed) when one forward left them
    all, and from the host's copy when the prompts ended in several (short prompts, a token a forward)."""
    model, inputs, prefixes, seeded = SEARCHES[case]
    engine, _, reference, _ = request.getfixturevalue(model)
    encoder_decoder = model == "m2m100"
    eos = (2, frequent_token(reference, inputs[0], **(dict(decoder_input_ids=torch.tensor([[START]], device="cuda"),
                                                          decoder_start_token_id=START) if encoder_decoder else {})))
    requests = beam_requests(inputs, encoder_decoder, length_penalty, early_stopping, prefixes)
    free, runner = engine.cache.blocks.num_free, engine.runner
    searches, reads, ctx = [], [], runner.stream_context
    original, copy_to_host = runner.device_search, ctx.copy_to_host
    monkeypatch.setattr(runner, "device_search", lambda *a: searches.append(original(*a)) or searches[-1])
    monkeypatch.setattr(ctx, "copy_to_host", lambda *a: reads.append(len(searches)) or copy_to_host(*a))
    on_device = engine.beam_generate(requests, eos, FILL)
    assert len(searches) == 1 and searches[0] is not None and searches[0].generated > 1    # it did run there
    # Seeded, the host waited for nothing before the hand-over (no copy back), and the buffer is free again.
    assert searches[0].seeded == seeded and (min(reads) == 1) == seeded
    assert ctx.latest_candidates is None or not seeded
    monkeypatch.setattr(runner, "device_search", lambda *a: None)
    on_host = engine.beam_generate(requests, eos, FILL)
    assert engine.cache.blocks.num_free == free
    for ours, theirs in zip(on_device, on_host):
        assert [t for t, _ in ours.hypotheses] == [t for t, _ in theirs.hypotheses], ours.request_id
        assert torch.allclose(torch.tensor([s for _, s in ours.hypotheses]),
                              torch.tensor([s for _, s in theirs.hypotheses]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("when", ["mid-search", "prompt"])
def test_non_finite_logits_end_the_device_call_with_a_fault(tmp_path, monkeypatch, when):
    """Logits that turn NaN while the search runs on the device (the LM head poisoned once the prompt pass is
    done), or already in the prompt pass (whose candidates the device search starts from, never read on the
    host): the select kernel raises the fault flag, the call ends with DEVICE_FAULT, and every block comes back."""
    from cuda.bindings import driver

    from metrale.runtime.errors import DeviceFault

    engine, _ = engine_on_cuda(write_tiny("llama_tied", tmp_path / "llama", **WEIGHTS), tmp_path / "cache")
    runner, started = engine.runner, []
    original = runner.device_search

    def poison():
        head = engine.model.weights["lm_head"]
        driver.cuMemsetD32(head.ptr, 0x7FC07FC0, head.nbytes // 4)       # bf16 NaN, two to a word
        driver.cuCtxSynchronize()

    def poisoned(*args):
        search = original(*args)
        if when == "mid-search":
            poison()
        started.append(search)
        return search

    if when == "prompt":
        poison()
    monkeypatch.setattr(runner, "device_search", poisoned)
    free = engine.cache.blocks.num_free
    request = BeamRequest(1, prompt_tokens=tuple(PROMPTS[1]), params=BeamParams(num_beams=4, max_new_tokens=10,
                                                                                 min_new_tokens=10))
    with pytest.raises(DeviceFault, match="finite"):
        engine.beam_generate([request], (2,), FILL)
    assert started and started[0] is not None and engine.cache.blocks.num_free == free
    assert started[0].seeded
