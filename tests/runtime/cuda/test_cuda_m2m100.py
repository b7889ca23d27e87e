"""Encoder-decoder M2M100 on the CUDA backend (bf16) against transformers on the GPU, same checkpoint: the
encoder and teacher-forced decoder's logits, the encoder's and the decoder prompts' graphs against eager passes,
a gateway's own Prefill/Decode loop, and the layer math the model's decode step fuses (a linear into its LayerNorm as
split-K partials, cross-attention's query as partials) against their unfused forms and float64."""

import numpy as np
import pytest
import torch

from metrale.runtime.batch import Segment, build_batch, build_decode_batch
from metrale.runtime.backend.cuda.batch import PrefillPadding
from metrale.runtime.backend.layer_math import Linear
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.sequence import BlockTable
from cuda_engines import SOURCES, START, as_float
from gateway_loop import forced_then_greedy

from gpu_reference import relative_error

pytestmark = pytest.mark.gpu


def encode(engine, batch) -> None:
    """The encoder over the batch's sources as the engine runs it: a graph replay where one fits."""
    engine.runner.run_encoder(engine.forwards.encode, batch, engine.model.replayable(batch))


def run_forward(engine, batch):
    """The decoder's logits as the engine runs a forward: a graph replay where one fits."""
    return engine.runner.run_forward(engine.forwards.forward, batch, engine.model.replayable(batch))


def test_m2m100_logits_match_transformers(m2m100):
    engine, info, reference, reference_bf16 = m2m100
    assert info.architecture == "M2M100ForConditionalGeneration" and engine.supports_beam
    decoder = [[START, 33, 61, 90, 14], [START, 44], [START, 9, 9, 1, 7]]   # a padding id (1) among them too
    size, free = engine.config.kv_block_size, iter(range(engine.cache.blocks.num_blocks))
    cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in SOURCES[:3]]
    encode(engine, build_batch([Segment(t, 0, s, False) for t, s in zip(cross, SOURCES)], size))
    segments = [Segment(BlockTable([next(free)]), 0, tokens, True, (table, len(source)))
                for tokens, table, source in zip(decoder, cross, SOURCES)]
    batch = build_batch(segments, size)
    batch.sample_rows = torch.arange(batch.num_tokens)         # every row's logits, not only the last
    ours = as_float(engine.runner.stream_context.copy_to_host(run_forward(engine, batch)))     # the LM head's bf16 bits
    errors, theirs = [], []
    with torch.no_grad():
        for (s, d), start in zip(zip(SOURCES, decoder), batch.query_starts):
            inputs = dict(input_ids=torch.tensor([s], device="cuda"),
                          decoder_input_ids=torch.tensor([d], device="cuda"))
            expected = reference(**inputs).logits[0].float().cpu()
            errors.append(relative_error(ours[start:start + len(d)], expected))
            theirs.append(relative_error(reference_bf16(**inputs).logits[0].float().cpu(), expected))
    print(f"m2m100: relative error ours {max(errors):.2e}, transformers bf16 {max(theirs):.2e}")
    assert max(errors) < max(1e-2, 1.25 * max(theirs)), (errors, theirs)


def cross_kv(engine, layer: int, tables, sources) -> torch.Tensor:
    """The K and V one decoder layer's cache holds for each source's tokens, as float32 bit patterns (int32),
    source after source."""
    kv = engine.cache.layers[layer]
    bits = torch.from_numpy(engine.runner.stream_context.copy_to_host(kv).astype("int32") << 16).reshape(kv.shape)
    return torch.cat([bits[:, table.array()].flatten(1, 2)[:, :len(source)] for table, source in zip(tables, sources)],
                     dim=1)


def test_m2m100_encoder_replays_a_graph_per_padded_shape(m2m100):
    """Two batches of one padded shape (64 rows, 4 sources, 64-row sources): the first captures the encoder's
    graph, the second replays it over its own metadata; each writes the cross-attention K/V the eager pass writes
    (within bf16 rounding: cuBLASLt may take other kernels for 64 rows) and nothing past its sources."""
    engine, _, _, _ = m2m100
    size, layers = engine.config.kv_block_size, engine.cache.layers
    graphs = engine.runner.stream_context.encoder_graphs
    free = iter(range(engine.cache.blocks.num_blocks - 1, 0, -1))      # blocks no other test of the module holds
    untouched = BlockTable([next(free)])
    before = cross_kv(engine, 0, [untouched], [[0] * size])
    for sources in (SOURCES[:3], [[9, 8, 7, 2], [5] * 20 + [2], [3, 2]]):
        tables, eager = ([BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in sources]
                         for _ in range(2))
        assert graphs.padding(build_batch([Segment(t, 0, s, False) for t, s in zip(tables, sources)], size)) == (
            PrefillPadding(64, 4, 64))
        replays = graphs.replays
        encode(engine, build_batch([Segment(t, 0, s, False) for t, s in zip(tables, sources)], size))
        assert graphs.replays == replays + 1
        engine.model._encode(build_batch([Segment(t, 0, s, False) for t, s in zip(eager, sources)], size),
                             layers, host_positions=False)
        for layer in (0, len(layers) - 1):
            ours, expected = (cross_kv(engine, layer, t, sources).view(torch.float32) for t in (tables, eager))
            assert relative_error(ours, expected) < 1e-2
    assert torch.equal(cross_kv(engine, 0, [untouched], [[0] * size]), before)


def test_m2m100_decoder_prompts_replay_a_graph_per_padded_shape(m2m100):
    """Two batches of NLLB-style prompts (the start token, a target language, a longer prefix) of one padded shape
    (16 rows, 4 segments of up to 4 tokens, 4 sampled): the first captures the prompt graph, the second replays it
    over its own metadata and cross batch; each gives the eager forward's logits and self-attention K/V (within
    bf16 rounding) and writes nothing past its prompts."""
    engine, _, _, _ = m2m100
    runner, size, layers = engine.runner, engine.config.kv_block_size, engine.cache.layers
    graphs, last = runner.stream_context.prompt_graphs, len(layers) - 1
    free = iter(range(engine.cache.blocks.num_blocks - 1, 0, -1))      # blocks no other test of the module holds
    untouched = BlockTable([next(free)])
    before = cross_kv(engine, last, [untouched], [[0] * size])
    sources = SOURCES[:3]
    for prompts in ([[START, 200], [START], [START, 201, 5]], [[START, 9], [START, 200, 7], [START]]):
        cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in sources]
        encode(engine, build_batch([Segment(t, 0, s, False) for t, s in zip(cross, sources)], size))
        tables, eager = ([BlockTable([next(free)]) for _ in prompts] for _ in range(2))

        def batch(blocks):
            return build_batch([Segment(t, 0, p, True, (c, len(s)))
                                for t, p, c, s in zip(blocks, prompts, cross, sources)], size)
        assert graphs.padding(batch(tables)) == PrefillPadding(16, 4, 4, sampled=4)
        replays = graphs.replays
        ours = as_float(runner.stream_context.copy_to_host(run_forward(engine, batch(tables))))
        assert graphs.replays == replays + 1 and ours.shape[0] == len(prompts)
        expected = as_float(runner.stream_context.copy_to_host(engine.model._decode(batch(eager), layers, host_positions=False)))
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
    replays = engine.runner.stream_context.graphs.replays
    decoded, rows, _ = forced_then_greedy(engine, sources, {1: 200, 2: 201}, 8, START)
    # the prefill's decoder rows (one start token each, after the encoder) and each Decode: a graph with its cross batch
    assert engine.runner.stream_context.graphs.replays == replays + 9
    for i, source in sources.items():
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([source], device="cuda"),
                                 decoder_input_ids=torch.tensor([decoded[i]], device="cuda")).logits[0].float().cpu()
        assert relative_error(torch.stack(rows[i]), expected) < 2e-2
    engine.release(list(sources))
    assert engine.cache.blocks.num_free == engine.cache.blocks.num_blocks


@pytest.mark.parametrize("rows", [9, 64, 65, 256, 300])
@pytest.mark.parametrize("k", [1024, 4096])
def test_layer_norm_of_a_linear_equals_the_linear_then_the_norm(m2m100, rows, k):
    """LayerMath.layer_norm of a Linear at the row counts where the CUDA backend hands the norm split-K partials
    (9-64 rows; a K past 2048 up to 256) and where it does not: the same as linear() then layer_norm() within bf16
    rounding of the linear's sum, and both against float64."""
    engine = m2m100[0]
    math, n = engine.model.math, 64
    generator = torch.Generator(device="cuda").manual_seed(rows + k)
    x = torch.randn(rows, k, generator=generator, device="cuda").bfloat16()
    weight = (torch.randn(n, k, generator=generator, device="cuda") / k ** 0.5).bfloat16()
    bias, norm_bias = (0.5 * torch.randn(2, n, generator=generator, device="cuda")).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(n, generator=generator, device="cuda")).bfloat16()
    residual = (2 * torch.randn(rows, n, generator=generator, device="cuda")).bfloat16()
    torch.cuda.synchronize()
    args = [DeviceTensor.from_torch(t) for t in (x, weight, bias, norm_weight, norm_bias)]
    fused = math.layer_norm(Linear(*args[:3]), *args[3:], 1e-5, DeviceTensor.from_torch(residual))
    plain = math.layer_norm(math.linear(*args[:3]), *args[3:], 1e-5, DeviceTensor.from_torch(residual))

    def read(tensor):
        return torch.from_numpy((math.stream_context.copy_to_host(tensor).astype(np.uint32) << 16).view(np.float32))
    (out, added), (plain_out, plain_added) = [(read(a), read(b)) for a, b in (fused, plain)]
    linear = x.double() @ weight.double().T + bias.double()
    exact_added = linear.cpu() + residual.double().cpu()
    exact = torch.nn.functional.layer_norm(exact_added, (n,), norm_weight.double().cpu(), norm_bias.double().cpu(),
                                           1e-5)
    assert relative_error(added, exact_added) < 1e-2 and relative_error(out, exact) < 1e-2
    assert relative_error(added, plain_added) < 1e-2 and relative_error(out, plain_out) < 1e-2


@pytest.mark.parametrize("rows", [8, 9, 64])
def test_cross_attention_of_a_linear_equals_the_linear_then_the_attention(m2m100, rows):
    """LayerMath.paged_attention (causal=False) of a Linear query over decode rows where the CUDA backend hands the
    attention kernel its query as split-K partials (9-64 rows) and where it does not (the skinny GEMM's 8): the same
    as linear() then paged_attention() within bf16 rounding of the query's sum, and both against float64, over
    sources the encoder wrote."""
    engine = m2m100[0]
    math, size, c = engine.model.math, engine.config.kv_block_size, engine.model.config
    free = iter(range(engine.cache.blocks.num_blocks - 1, 0, -1))      # blocks no other test of the module holds
    cross = [BlockTable([next(free) for _ in range(-(-len(s) // size))]) for s in SOURCES]
    encode(engine, build_batch([Segment(t, 0, s, False) for t, s in zip(cross, SOURCES)], size))
    own = next(free)
    batch = build_decode_batch([5] * rows, [0] * rows, [[own]] * rows, size,
                               [(cross[i % len(SOURCES)], len(SOURCES[i % len(SOURCES)])) for i in range(rows)])
    weight, bias = engine.model.weights["decoder"][0]["cross_q"]
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, c.hidden_size, generator=generator, device="cuda").bfloat16()
    torch.cuda.synchronize()
    math.prepare(batch)
    meta, kv, scale = math.prepare(batch.cross, cross=True), engine.cache.layers[0], c.head_dim ** -0.5
    ours = math.paged_attention(Linear(DeviceTensor.from_torch(x), weight, bias), kv, meta, c.num_heads, c.head_dim,
                                scale, None, causal=False)
    plain = math.paged_attention(math.linear(DeviceTensor.from_torch(x), weight, bias), kv, meta, c.num_heads,
                                 c.head_dim, scale, None, causal=False)
    ours, plain, w, b = (as_float(math.stream_context.copy_to_host(t)).double() for t in (ours, plain, weight, bias))
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
