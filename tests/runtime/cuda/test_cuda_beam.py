"""Encoder-decoder M2M100 and beam search on the CUDA backend (bf16) against transformers on the GPU, same
checkpoint: the encoder and teacher-forced decoder's logits, a gateway's own Prefill/Decode loop, and
BeamGenerate on M2M100 and on a decoder-only Llama.

Beam search over bf16 logits follows transformers' float32 run token for token only where the rounding does not
decide it. The tests tell those requests apart without guessing at ties: our search runs on the host once more
with its logits recorded by prefix (beam_reference.LogitsRecorder), transformers' float32 generate is replayed
over those logits (replayed_hypotheses) and must give exactly our hypotheses; where that replay decides as
transformers does over its own float32 logits, ours must be transformers' hypotheses, scores within 1e-2. The
device search gives the host search's hypotheses exactly."""

import collections
import itertools

import numpy as np
import pytest
import torch

from metrale.runtime.batch import Segment, build_batch, build_decode_batch
from metrale.runtime.beam.params import BeamParams, BeamRequest
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.backend.cuda.batch import PrefillPadding
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.sequence import BlockTable
from beam_reference import FILL, LogitsRecorder, check_search, reference_hypotheses
from gateway_loop import forced_then_greedy
from tiny_models import write_tiny, write_tiny_m2m100

from gpu_reference import relative_error

pytestmark = pytest.mark.gpu
SOURCES = [[5, 17, 99, 3, 42, 2], [7, 8, 150, 33, 61, 90, 14, 77, 101, 12, 2], [250, 2], [4, 66, 31] * 6 + [2]]
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 150, 33, 61, 2, 90, 14, 77, 101, 12], [250], [4, 66, 31, 9, 180, 44, 71] * 3]
# Prompts short enough to run a token a forward (runner.SHORT_PROMPT), ending in different forwards.
SHORT_PROMPTS = [[5, 17], [7, 8, 150], [250], [4, 66, 31, 9]]
START = 2
# Weights at a trained model's scale (bf16 rounding stays bf16-sized), the LM head's logits spread enough that
# beam search has decisions clearer than bf16 noise.
WEIGHTS = dict(weight_std=0.08, norm_std=0.1)


def engine_on_cuda(directory, tmp_path):
    return build_engine(load_checkpoint(directory), EngineConfig(device="cuda", kv_blocks=512, kv_block_size=16,
                                                                 max_batch_tokens=512, max_seqs=64),
                        cache_dir=tmp_path / "cache")


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    import transformers

    directory = write_tiny_m2m100(tmp_path_factory.mktemp("m2m100") / "m2m100", **WEIGHTS)
    engine, info = engine_on_cuda(directory, tmp_path_factory.mktemp("m2m100-cache"))
    load = transformers.M2M100ForConditionalGeneration.from_pretrained
    return (engine, info, load(directory, dtype=torch.float32).cuda().eval(),
            load(directory, dtype=torch.bfloat16).cuda().eval())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import transformers

    directory = write_tiny("llama_tied", tmp_path_factory.mktemp("beam-llama") / "llama", **WEIGHTS)
    engine, info = engine_on_cuda(directory, tmp_path_factory.mktemp("llama-cache"))
    load = transformers.AutoModelForCausalLM.from_pretrained
    return (engine, info, load(directory, dtype=torch.float32).cuda().eval(),
            load(directory, dtype=torch.bfloat16).cuda().eval())


def as_float(bf16: np.ndarray) -> torch.Tensor:
    """bf16 bits (as copied back) as float32 values."""
    return torch.from_numpy((bf16.astype(np.uint32) << 16).view(np.float32))


def test_m2m100_logits_match_transformers(m2m100):
    engine, info, reference, reference_bf16 = m2m100
    assert info.architecture == "M2M100ForConditionalGeneration" and engine.supports_beam
    decoder = [[START, 33, 61, 90, 14], [START, 44], [START, 9, 9, 1, 7]]   # a padding id (1) among them too
    size, free = engine.config.kv_block_size, iter(range(engine.blocks.num_blocks))
    cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in SOURCES[:3]]
    engine.model.encode(build_batch([Segment(t, 0, s, False) for t, s in zip(cross, SOURCES)], size),
                        engine.kv_cache)
    segments = [Segment(BlockTable([next(free)]), 0, tokens, True, (table, len(source)))
                for tokens, table, source in zip(decoder, cross, SOURCES)]
    batch = build_batch(segments, size)
    batch.sample_rows = torch.arange(batch.num_tokens)         # every row's logits, not only the last
    ops = engine.model.ops
    ours = as_float(ops.lane.copy_to_host(ops.run_forward(engine.forward, batch)))     # the LM head's bf16 bits
    errors, theirs = [], []
    with torch.no_grad():
        for (s, d), start in zip(zip(SOURCES, decoder), batch.query_starts):
            inputs = dict(input_ids=torch.tensor([s], device="cuda"), decoder_input_ids=torch.tensor([d], device="cuda"))
            expected = reference(**inputs).logits[0].float().cpu()
            errors.append(relative_error(ours[start:start + len(d)], expected))
            theirs.append(relative_error(reference_bf16(**inputs).logits[0].float().cpu(), expected))
    print(f"m2m100: relative error ours {max(errors):.2e}, transformers bf16 {max(theirs):.2e}")
    assert max(errors) < max(1e-2, 1.25 * max(theirs)), (errors, theirs)


def cross_kv(engine, layer: int, tables, sources) -> torch.Tensor:
    """The K and V one decoder layer's cache holds for each source's tokens, as float32 bit patterns (int32),
    source after source."""
    kv = engine.kv_cache[layer]
    bits = torch.from_numpy(engine.model.ops.lane.copy_to_host(kv).astype("int32") << 16).reshape(kv.shape)
    return torch.cat([bits[:, table.array()].flatten(1, 2)[:, :len(source)] for table, source in zip(tables, sources)],
                     dim=1)


def test_m2m100_encoder_replays_a_graph_per_padded_shape(m2m100):
    """Two batches of one padded shape (64 rows, 4 sources, 64-row sources): the first captures the encoder's
    graph, the second replays it over its own metadata; each writes the cross-attention K/V the eager pass writes
    (within bf16 rounding: cuBLASLt may take other kernels for 64 rows) and nothing past its sources."""
    engine, _, _, _ = m2m100
    ops, size = engine.model.ops, engine.config.kv_block_size
    graphs = ops.lane.encoder_graphs
    free = iter(range(engine.blocks.num_blocks - 1, 0, -1))      # blocks no other test of the module holds
    untouched = BlockTable([next(free)])
    before = cross_kv(engine, 0, [untouched], [[0] * size])
    for sources in (SOURCES[:3], [[9, 8, 7, 2], [5] * 20 + [2], [3, 2]]):
        tables, eager = ([BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in sources]
                         for _ in range(2))
        assert graphs.padding(build_batch([Segment(t, 0, s, False) for t, s in zip(tables, sources)], size)) == (
            PrefillPadding(64, 4, 64))
        replays = graphs.replays
        engine.model.encode(build_batch([Segment(t, 0, s, False) for t, s in zip(tables, sources)], size),
                            engine.kv_cache)
        assert graphs.replays == replays + 1
        engine.model._encode(build_batch([Segment(t, 0, s, False) for t, s in zip(eager, sources)], size),
                             engine.kv_cache, host_positions=False)
        for layer in (0, len(engine.kv_cache) - 1):
            ours, expected = (cross_kv(engine, layer, t, sources).view(torch.float32) for t in (tables, eager))
            assert relative_error(ours, expected) < 1e-2
    assert torch.equal(cross_kv(engine, 0, [untouched], [[0] * size]), before)


def test_m2m100_decoder_prompts_replay_a_graph_per_padded_shape(m2m100):
    """Two batches of NLLB-style prompts (the start token, a target language, a longer prefix) of one padded shape
    (16 rows, 4 segments of up to 4 tokens, 4 sampled): the first captures the prompt graph, the second replays it
    over its own metadata and cross batch; each gives the eager forward's logits and self-attention K/V (within
    bf16 rounding) and writes nothing past its prompts."""
    engine, _, _, _ = m2m100
    ops, size = engine.model.ops, engine.config.kv_block_size
    graphs, last = ops.lane.prompt_graphs, len(engine.kv_cache) - 1
    free = iter(range(engine.blocks.num_blocks - 1, 0, -1))      # blocks no other test of the module holds
    untouched = BlockTable([next(free)])
    before = cross_kv(engine, last, [untouched], [[0] * size])
    sources = SOURCES[:3]
    for prompts in ([[START, 200], [START], [START, 201, 5]], [[START, 9], [START, 200, 7], [START]]):
        cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in sources]
        engine.model.encode(build_batch([Segment(t, 0, s, False) for t, s in zip(cross, sources)], size),
                            engine.kv_cache)
        tables, eager = ([BlockTable([next(free)]) for _ in prompts] for _ in range(2))

        def batch(blocks):
            return build_batch([Segment(t, 0, p, True, (c, len(s)))
                                for t, p, c, s in zip(blocks, prompts, cross, sources)], size)
        assert graphs.padding(batch(tables)) == PrefillPadding(16, 4, 4, sampled=4)
        replays = graphs.replays
        ours = as_float(ops.lane.copy_to_host(ops.run_forward(engine.forward, batch(tables))))
        assert graphs.replays == replays + 1 and ours.shape[0] == len(prompts)
        expected = as_float(ops.lane.copy_to_host(engine.model._decode(batch(eager), engine.kv_cache,
                                                                      host_positions=False)))
        assert relative_error(ours, expected) < 1e-2
        for layer in (0, last):
            theirs = cross_kv(engine, layer, eager, prompts).view(torch.float32)
            assert relative_error(cross_kv(engine, layer, tables, prompts).view(torch.float32), theirs) < 1e-2
    assert torch.equal(cross_kv(engine, last, [untouched], [[0] * size]), before)


def test_m2m100_prefill_and_decode_follow_transformers(m2m100):
    """The gateway's own loop on CUDA: Prefill the source (the encoder runs), Decode a forced token and the
    greedy ones after it; each step's logits against transformers' decoder over the same tokens."""
    engine, _, reference, _ = m2m100
    sources = {1: SOURCES[1], 2: SOURCES[3]}
    replays = engine.model.ops.lane.graphs.replays
    decoded, rows, _ = forced_then_greedy(engine, sources, {1: 200, 2: 201}, 8, START)
    # the prefill's decoder rows (one start token each, after the encoder) and each Decode: a graph with its cross batch
    assert engine.model.ops.lane.graphs.replays == replays + 9
    for i, source in sources.items():
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([source], device="cuda"),
                                 decoder_input_ids=torch.tensor([decoded[i]], device="cuda")).logits[0].float().cpu()
        assert relative_error(torch.stack(rows[i]), expected) < 2e-2
    engine.release(list(sources))
    assert engine.blocks.num_free == engine.blocks.num_blocks


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
    free = engine.blocks.num_free
    on_device = engine.beam_generate(requests, eos, FILL)
    with monkeypatch.context() as patch:
        patch.setattr(engine.model.ops, "device_beam_search", lambda *args: None)
        with LogitsRecorder(engine) as recorder:
            on_host = engine.beam_generate(requests, eos, FILL)
    assert engine.blocks.num_free == free
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
    free, ops = engine.blocks.num_free, engine.model.ops
    searches, reads, lane = [], [], ops._bound.lane
    original, copy_to_host = ops.device_beam_search, lane.copy_to_host
    monkeypatch.setattr(ops, "device_beam_search", lambda *a: searches.append(original(*a)) or searches[-1])
    monkeypatch.setattr(lane, "copy_to_host", lambda *a: reads.append(len(searches)) or copy_to_host(*a))
    on_device = engine.beam_generate(requests, eos, FILL)
    assert len(searches) == 1 and searches[0] is not None and searches[0].generated > 1    # it did run there
    # Seeded, the host waited for nothing before the hand-over (no copy back), and the buffer is free again.
    assert searches[0].seeded == seeded and (min(reads) == 1) == seeded
    assert lane.latest_candidates is None or not seeded
    monkeypatch.setattr(ops, "device_beam_search", lambda *a: None)
    on_host = engine.beam_generate(requests, eos, FILL)
    assert engine.blocks.num_free == free
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
    ops, started = engine.model.ops, []
    original = ops.device_beam_search

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
    monkeypatch.setattr(ops, "device_beam_search", poisoned)
    free = engine.blocks.num_free
    request = BeamRequest(1, prompt_tokens=tuple(PROMPTS[1]), params=BeamParams(num_beams=4, max_new_tokens=10,
                                                                                 min_new_tokens=10))
    with pytest.raises(DeviceFault, match="finite"):
        engine.beam_generate([request], (2,), FILL)
    assert started and started[0] is not None and engine.blocks.num_free == free
    assert started[0].seeded


@pytest.mark.parametrize("rows", [9, 64, 65, 256, 300])
@pytest.mark.parametrize("k", [1024, 4096])
def test_linear_layer_norm_equals_the_linear_then_the_norm(m2m100, rows, k):
    """Ops.linear_layer_norm at the row counts where the CUDA backend hands the norm split-K partials (9-64 rows; a
    K past 2048 up to 256) and where it does not: the same as linear() then layer_norm() within bf16 rounding of the
    linear's sum, and both against float64."""
    engine = m2m100[0]
    ops, n = engine.model.ops, 64
    generator = torch.Generator(device="cuda").manual_seed(rows + k)
    x = torch.randn(rows, k, generator=generator, device="cuda").bfloat16()
    weight = (torch.randn(n, k, generator=generator, device="cuda") / k ** 0.5).bfloat16()
    bias, norm_bias = (0.5 * torch.randn(2, n, generator=generator, device="cuda")).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(n, generator=generator, device="cuda")).bfloat16()
    residual = (2 * torch.randn(rows, n, generator=generator, device="cuda")).bfloat16()
    torch.cuda.synchronize()
    args = [DeviceTensor.from_torch(t) for t in (x, weight, bias, norm_weight, norm_bias)]
    fused = ops.linear_layer_norm(*args, 1e-5, DeviceTensor.from_torch(residual))
    plain = ops.layer_norm(ops.linear(*args[:3]), *args[3:], 1e-5, DeviceTensor.from_torch(residual))

    def read(tensor):
        return torch.from_numpy((ops.lane.copy_to_host(tensor).astype(np.uint32) << 16).view(np.float32))
    (out, added), (plain_out, plain_added) = [(read(a), read(b)) for a, b in (fused, plain)]
    linear = x.double() @ weight.double().T + bias.double()
    exact_added = linear.cpu() + residual.double().cpu()
    exact = torch.nn.functional.layer_norm(exact_added, (n,), norm_weight.double().cpu(), norm_bias.double().cpu(),
                                           1e-5)
    assert relative_error(added, exact_added) < 1e-2 and relative_error(out, exact) < 1e-2
    assert relative_error(added, plain_added) < 1e-2 and relative_error(out, plain_out) < 1e-2


@pytest.mark.parametrize("rows", [8, 9, 64])
def test_cross_attention_equals_the_linear_then_the_attention(m2m100, rows):
    """Ops.cross_attention over decode rows where the CUDA backend hands the attention kernel its query as split-K
    partials (9-64 rows) and where it does not (the skinny GEMM's 8): the same as linear() then paged_attention()
    within bf16 rounding of the query's sum, and both against float64, over sources the encoder wrote."""
    engine = m2m100[0]
    ops, size, c = engine.model.ops, engine.config.kv_block_size, engine.model.config
    free = iter(range(engine.blocks.num_blocks - 1, 0, -1))      # blocks no other test of the module holds
    cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in SOURCES]
    engine.model.encode(build_batch([Segment(t, 0, s, False) for t, s in zip(cross, SOURCES)], size),
                        engine.kv_cache)
    own = next(free)
    batch = build_decode_batch([5] * rows, [0] * rows, [[own]] * rows, size,
                               [(cross[i % len(SOURCES)], len(SOURCES[i % len(SOURCES)])) for i in range(rows)])
    weight, bias = engine.model.weights["decoder"][0]["cross_q"]
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, c.hidden_size, generator=generator, device="cuda").bfloat16()
    torch.cuda.synchronize()
    ops.prepare(batch)
    meta, kv, scale = ops.prepare(batch.cross, cross=True), engine.kv_cache[0], c.head_dim ** -0.5
    ours = ops.cross_attention(DeviceTensor.from_torch(x), weight, bias, kv, meta, c.num_heads, c.head_dim, scale)
    plain = ops.paged_attention(ops.linear(DeviceTensor.from_torch(x), weight, bias), kv, meta, c.num_heads,
                                c.head_dim, scale, None, causal=False)
    ours, plain, w, b = (as_float(ops.lane.copy_to_host(t)).double() for t in (ours, plain, weight, bias))
    q = (x.double().cpu() @ w.T + b).view(rows, c.num_heads, c.head_dim)
    keys = cross_kv(engine, 0, cross, SOURCES).view(torch.float32).double()     # [2, tokens of every source, ...]
    starts = np.cumsum([0] + [len(s) for s in SOURCES])
    exact = torch.empty(rows, c.num_heads, c.head_dim, dtype=torch.float64)
    for row in range(rows):
        i = row % len(SOURCES)
        k, v = (part.view(-1, c.num_heads, c.head_dim) for part in keys[:, starts[i]:starts[i + 1]])
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[row], k) * scale, dim=-1)
        exact[row] = torch.einsum("ht,thd->hd", weights, v)
    assert relative_error(ours, exact.view(rows, -1)) < 1e-2 and relative_error(ours, plain) < 1e-2
