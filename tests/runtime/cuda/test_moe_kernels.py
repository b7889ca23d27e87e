"""moe.cu against the CPU backend's torch math (backend/cpu/moe.py) on the same inputs: the router's choice from the
same float32 logits (softmax and DeepSeek-V3's grouped sigmoid, with exactly tied scores, which must go as
torch.topk on the GPU breaks them, as transformers' run there does: the lower expert id), the same launch's
grouping of the entries by expert, and a whole layer (route, the grouped GEMMs with silu between, the combine with
shared experts) at decode and prefill row counts, up to Qwen3-30B-A3B's mixture (128 experts, top-8, 2048 x 768);
and FP8 experts (e4m3, a scale a row or 128 x 128 blocks) against the bf16 experts of the weights they
dequantize to."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cpu.moe import choose  # noqa: E402
from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix, device_scales  # noqa: E402
from metrale.runtime.backend.cuda.kernels import activation, moe  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.backend.layer_math import MoeRouter  # noqa: E402
from metrale.runtime.loading.fp8 import E4M3_MAX, Fp8Experts, Fp8Weight, quantize_rows, to_e4m3  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
d = DeviceTensor.from_torch

# (tokens, experts, top_k, softmax, n_group, topk_group): decode and prefill rows, every router kind.
ROUTERS = [(1, 8, 2, True, 1, 1), (37, 128, 8, True, 1, 1), (300, 64, 6, True, 1, 1), (9, 256, 8, False, 8, 4),
           (64, 32, 4, False, 4, 2), (5, 512, 16, False, 1, 1)]


def logits_for(tokens: int, experts: int, softmax: bool, ties: bool) -> torch.Tensor:
    """Random float32 logits (bf16-representable: the kernel rounds softmax routers' logits to bf16); with ties,
    each odd expert's column a copy of the even one before it."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens + experts)).bfloat16().float()
    if ties:
        logits[:, 1::2] = logits[:, 0::2]
    return logits


def routed_buffers(tokens: int, experts: int, top_k: int) -> tuple[moe.Routed, list[torch.Tensor]]:
    """A Routed over torch buffers (filled with -7: a slot the kernel leaves unwritten shows), and the buffers, the
    route's done counter (0) last."""
    entries = tokens * top_k
    rows = moe.tile_rows(entries, experts)
    full = lambda *shape: torch.full(shape, -7, dtype=torch.int32, device=DEVICE)  # noqa: E731
    kept = [full(tokens, top_k), torch.full((tokens, top_k), float("nan"), device=DEVICE), full(experts + 1),
            full(entries), full(entries), full(moe.max_tiles(entries, experts, rows), 2), full(1),
            torch.zeros(1, dtype=torch.int32, device=DEVICE)]
    return moe.Routed(*(d(t) for t in kept[:-1]), rows), kept


def launch_route(kernel_library, stream, routed: moe.Routed, kept, logits: torch.Tensor, router: MoeRouter, bias):
    """logits and bias on the device already: DeviceTensor.from_torch holds no reference, so a temporary's memory
    would go back to torch's allocator, and to its next tensor, before the launch has read it."""
    assert logits.is_cuda and (bias is None or bias.is_cuda)
    moe.route(kernel_library, stream, routed, d(logits), router.top_k, router.scoring == "softmax",
              router.normalize, None if bias is None else d(bias), router.n_group, router.topk_group, router.scaling,
              d(kept[-1]), router.group_score, router.float32_logits)


def device_route(kernel_library, stream, logits: torch.Tensor, router: MoeRouter, bias):
    routed, kept = routed_buffers(logits.shape[0], logits.shape[1], router.top_k)
    logits = logits.to(DEVICE)
    torch.cuda.synchronize()
    launch_route(kernel_library, stream, routed, kept, logits, router, bias)
    stream.sync()
    assert kept[-1].item() == 0, "the route leaves its done counter at 0 for the next launch"
    return kept[0].long().cpu(), kept[1].cpu()


def as_sets(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (ids, weights) in expert order: the order of a token's choices changes no output."""
    ids, order = ids.sort(dim=-1)
    return ids, weights.gather(1, order)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tokens, experts, top_k, softmax, n_group, topk_group", ROUTERS)
def test_route_matches_the_cpu_math(kernel_library, stream, tokens, experts, top_k, softmax, n_group, topk_group,
                                    ties):
    logits = logits_for(tokens, experts, softmax, ties)
    bias = None
    if not softmax:
        bias = 0.1 * torch.randn(experts, generator=torch.Generator().manual_seed(5))
        if ties:
            bias[1::2] = bias[0::2]
    router = MoeRouter(None, top_k, "softmax" if softmax else "sigmoid", normalize=softmax or n_group > 1,
                       correction_bias=bias, n_group=n_group, topk_group=topk_group, scaling=1.0 if softmax else 2.5)
    on_device = router if bias is None else MoeRouter(None, top_k, router.scoring, router.normalize, bias.to(DEVICE),
                                                      n_group, topk_group, router.scaling)
    want_ids, want_weights = (t.cpu() for t in as_sets(*choose(logits.to(DEVICE), on_device)))
    ids, weights = device_route(kernel_library, stream, logits, router, None if bias is None else bias.to(DEVICE))
    got_ids, got_weights = as_sets(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tokens, experts, top_k, n_group, topk_group", [(1, 64, 6, 1, 1), (37, 160, 6, 8, 3),
                                                                         (200, 64, 6, 8, 3)])
def test_deepseek_v2_route_matches_the_cpu_math(kernel_library, stream, tokens, experts, top_k, n_group, topk_group):
    """DeepSeek-V2's router: softmax over float32 logits (not rounded to bf16: logits off the bf16 grid show it),
    greedy or over the groups of the highest best score, the weights unnormalised and scaled."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    router = MoeRouter(None, top_k, "softmax", normalize=False, n_group=n_group, topk_group=topk_group, scaling=16.0,
                       group_score="max", float32_logits=True)
    want_ids, want_weights = (t.cpu() for t in as_sets(*choose(logits.to(DEVICE), router)))
    ids, weights = device_route(kernel_library, stream, logits, router, None)
    got_ids, got_weights = as_sets(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (40, 16, 4), (300, 8, 2), (256, 128, 8)])
def test_route_groups_the_entries_by_expert(kernel_library, stream, tokens, experts, top_k):
    """Logits that make each token choose given experts (decreasing logits in their order), then the grouping the
    same launch's last block writes; launched twice, as a graph replays it (the done counter back at 0)."""
    routed, kept = routed_buffers(tokens, experts, top_k)
    ids = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)])
    logits = torch.zeros(tokens, experts).scatter_(1, ids, torch.arange(top_k, 0, -1.0).expand(tokens, top_k) + 9)
    router = MoeRouter(None, top_k, "softmax", normalize=True)
    logits_on_device = logits.to(DEVICE)
    torch.cuda.synchronize()
    for _ in range(2):
        launch_route(kernel_library, stream, routed, kept, logits_on_device, router, None)
    stream.sync()
    assert torch.equal(kept[0].long().cpu(), ids) and kept[-1].item() == 0
    offsets, sorted_entries, positions, tiles, count = (t.cpu() for t in kept[2:7])
    flat = ids.flatten().long()
    counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(offsets, torch.cat([torch.zeros(1), counts.cumsum(0)]).int())
    assert torch.equal(sorted_entries[positions.long()], torch.arange(len(flat), dtype=torch.int32))
    for e in range(experts):        # each expert's rows hold its entries
        assert (flat[sorted_entries[offsets[e]:offsets[e + 1]].long()] == e).all()
    rows = routed.tile_rows
    want = [(e, offsets[e].item() + first) for e in range(experts) for first in range(0, counts[e].item(), rows)]
    assert count.item() == len(want)
    assert [tuple(t) for t in tiles[:len(want)].tolist()] == want


def device_weight(weight, held: list[torch.Tensor]):
    """A bf16 torch weight on the device as it is, an Fp8Experts as the CUDA backend uploads it (an Fp8Matrix), its
    torch tensors appended to held: the caller keeps them until its launches have run (from_torch holds no
    reference)."""
    if isinstance(weight, Fp8Experts):
        scales = device_scales(weight)
        held += [weight.data.to(DEVICE), scales.to(DEVICE)]
        return Fp8Matrix(d(held[-2]), d(held[-1]), blocks=scales.dim() == weight.dim())
    return d(weight)


def device_layer(kernel_library, stream, x, logits, router: MoeRouter, gate_up, down, bias, shared, fused=True):
    """CudaLayerMath.moe's launches with torch buffers, from the given router logits; fused: the activation in the up
    GEMM's epilogue (its rows interleaved), else activation.cu's silu_mul after it. gate_up and down: bf16 tensors,
    or both Fp8Experts."""
    tokens, hidden = x.shape
    experts, top_k, width = gate_up.shape[0], router.top_k, down.shape[2]
    routed, kept = routed_buffers(tokens, experts, top_k)
    gate_up_rows = torch.empty(tokens * top_k, 2 * width, dtype=torch.bfloat16, device=DEVICE)
    activated = torch.full((tokens * top_k, width), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    expert_out = torch.empty(tokens * top_k, hidden, dtype=torch.bfloat16, device=DEVICE)
    out = torch.full_like(x, float("nan"))
    interleaved = moe.interleave_gate_up(gate_up) if fused else None
    interleaved = interleaved.contiguous() if isinstance(interleaved, torch.Tensor) else interleaved
    held = [logits.to(DEVICE)]
    up_weight, down_weight = device_weight(interleaved if fused else gate_up, held), device_weight(down, held)
    torch.cuda.synchronize()            # torch's fills and copies, before the kernels' stream reads them
    launch_route(kernel_library, stream, routed, kept, held[0], router, bias)
    if fused:
        moe.grouped_gemm(kernel_library, stream, d(activated), d(x), up_weight, routed, gather_div=top_k, gated=True)
    else:
        moe.grouped_gemm(kernel_library, stream, d(gate_up_rows), d(x), up_weight, routed, gather_div=top_k)
        activation.silu_mul(kernel_library, stream, d(activated), d(gate_up_rows))
    moe.grouped_gemm(kernel_library, stream, d(expert_out), d(activated), down_weight, routed, gather_div=0)
    moe.combine(kernel_library, stream, d(out), d(expert_out), routed, None if shared is None else d(shared))
    stream.sync()
    return out.float().cpu(), kept[0].long().cpu()


# (tokens, experts, top_k, hidden, width, softmax, shared): tiles of 8 rows (decode: the skinny GEMM) and of 64 and
# 128 (the tiled one), K and N not multiples of the tiles' (96 and 200).
LAYERS = [(1, 8, 2, 128, 64, True, False), (7, 16, 4, 256, 48, False, True), (40, 8, 3, 256, 64, True, False),
          (300, 8, 2, 128, 96, True, False), (4, 128, 8, 2048, 768, True, False), (256, 128, 8, 2048, 768, True, True),
          (512, 128, 8, 2048, 768, True, True), (200, 16, 4, 200, 96, True, False),
          (2048, 128, 8, 2048, 768, True, False)]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, width, softmax, shared", LAYERS)
def test_layer_matches_the_cpu_math(kernel_library, stream, tokens, experts, top_k, hidden, width, softmax, shared):
    torch.manual_seed(0)
    x = (torch.randn(tokens, hidden, device=DEVICE)).bfloat16()
    gate_up = (0.05 * torch.randn(experts, 2 * width, hidden, device=DEVICE)).bfloat16()
    down = (0.05 * torch.randn(experts, hidden, width, device=DEVICE)).bfloat16()
    shared_out = torch.randn(tokens, hidden, device=DEVICE).bfloat16() if shared else None
    bias = None if softmax else 0.1 * torch.randn(experts, device=DEVICE)
    router = MoeRouter(None, top_k, "softmax" if softmax else "sigmoid", normalize=True,
                       correction_bias=None if bias is None else bias.cpu(), n_group=1 if softmax else 4,
                       topk_group=1 if softmax else 2, scaling=1.0 if softmax else 2.5)
    logits = logits_for(tokens, experts, softmax, ties=False)
    out, ids = device_layer(kernel_library, stream, x, logits, router, gate_up, down, bias, shared_out)
    # The activation in the up GEMM's epilogue is the separate kernel's, bit for bit.
    unfused, _ = device_layer(kernel_library, stream, x, logits, router, gate_up, down, bias, shared_out, fused=False)
    assert torch.equal(out, unfused)

    weights, want_ids = choose(logits.to(DEVICE), MoeRouter(None, top_k, router.scoring, True, bias, router.n_group,
                                                            router.topk_group, router.scaling))
    assert torch.equal(as_sets(weights.cpu(), ids)[0], as_sets(weights.cpu(), want_ids.cpu())[0])
    # Each expert over its tokens, in float64 on the GPU.
    want = torch.zeros(tokens, hidden, dtype=torch.float64, device=DEVICE)
    for e in want_ids.unique().tolist():
        token, j = torch.where(want_ids == e)
        gate, up = (x[token].double() @ gate_up[e].double().T).chunk(2, dim=-1)
        want.index_add_(0, token, weights[token, j, None].double() * ((F.silu(gate) * up) @ down[e].double().T))
    if shared:
        want += shared_out.double()
    assert relative_error(out, want) < TOLERANCE[torch.bfloat16]


def in_blocks(weight: torch.Tensor) -> Fp8Weight:
    """weight [rows, columns] in e4m3 with a scale a row for each 128 columns (columns % 128 == 0), as Fp8Weight holds
    a release's 128 x 128 blocks, but each row's and block's scale its own (its amax over 448, times 1, 2, 4 or 8):
    a scale read for the wrong row or block shows."""
    rows, columns = weight.shape
    blocks = weight.float().view(rows, columns // 128, 128)
    scales = blocks.abs().amax(-1) / E4M3_MAX * 2.0 ** torch.randint(0, 4, (rows, columns // 128))
    return Fp8Weight(to_e4m3(blocks / scales[..., None]).view(rows, columns), scales, 128)


def fp8_experts(form: str, experts: int, rows: int, columns: int) -> Fp8Experts:
    """Random experts stacked as models/moe.py stacks a checkpoint's: quantized with a scale a row (--quantize fp8),
    or in blocks of 128 columns (in_blocks)."""
    weights = [0.05 * torch.randn(rows, columns) for _ in range(experts)]
    return torch.stack([quantize_rows(w) if form == "rows" else in_blocks(w) for w in weights])


# Layers whose widths the form takes: rows, multiples of 16; blocks, of 128 (K over one or several blocks, decode
# and prefill rows; a partial tile of N: test_fp8_experts_in_blocks_with_a_partial_tile_of_n).
FP8_LAYERS = ([("rows", *layer) for layer in LAYERS if layer[3] % 16 == 0 and layer[4] % 16 == 0]
              + [("blocks", *layer) for layer in LAYERS if layer[3] % 128 == 0 and layer[4] % 128 == 0]
              + [("blocks", 3, 8, 2, 384, 256, True, True), ("blocks", 300, 8, 2, 256, 256, True, False)])


@pytest.mark.parametrize("form, tokens, experts, top_k, hidden, width, softmax, shared", FP8_LAYERS)
def test_fp8_experts_are_the_bf16_experts_of_their_dequantized_weights(kernel_library, stream, form, tokens, experts,
                                                                       top_k, hidden, width, softmax, shared):
    """W8A16: each weight widened to the bf16 value it dequantizes to. The tiled GEMM then runs the bf16 GEMM's
    mmas in its order, bit for bit; the skinny GEMM splits K in other steps (16 columns a load, not 8), within
    bf16's rounding."""
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    gate_up = fp8_experts(form, experts, 2 * width, hidden)
    down = fp8_experts(form, experts, hidden, width)
    assert isinstance(gate_up, Fp8Experts) and isinstance(down, Fp8Experts)
    assert device_weight(moe.interleave_gate_up(gate_up), []).blocks == (form == "blocks")
    shared_out = torch.randn(tokens, hidden, device=DEVICE).bfloat16() if shared else None
    router = MoeRouter(None, top_k, "softmax", normalize=True)
    logits = logits_for(tokens, experts, True, ties=False)
    out, ids = device_layer(kernel_library, stream, x, logits, router, gate_up, down, None, shared_out)
    want, want_ids = device_layer(kernel_library, stream, x, logits, router,
                                  gate_up.dequantize().bfloat16().to(DEVICE), down.dequantize().bfloat16().to(DEVICE),
                                  None, shared_out)
    assert torch.equal(ids, want_ids)
    if moe.tile_rows(tokens * top_k, experts) >= 64:
        assert torch.equal(out, want)
    else:
        assert relative_error(out, want.double()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("tokens, tile_rows", [(3, 8), (60, 64), (700, 128)])      # 8 experts, top-2
def test_fp8_experts_in_blocks_with_a_partial_tile_of_n(kernel_library, stream, tokens, tile_rows):
    """One grouped GEMM (not gated) over FP8 experts in blocks whose N, 200, leaves a partial tile of 128 and of 16
    columns, K over three blocks: the bf16 GEMM of the dequantized weights (tiled, bit for bit; skinny, within
    bf16's rounding)."""
    experts, top_k, n, k = 8, 2, 200, 384
    torch.manual_seed(2)
    weight = torch.stack([in_blocks(0.05 * torch.randn(n, k)) for _ in range(experts)])
    x = torch.randn(tokens, k, device=DEVICE).bfloat16()
    router = MoeRouter(None, top_k, "softmax", normalize=True)
    logits = logits_for(tokens, experts, True, ties=False)
    assert moe.tile_rows(tokens * top_k, experts) == tile_rows and device_weight(weight, []).blocks
    outs = []
    for form in (weight, weight.dequantize().bfloat16().to(DEVICE)):
        routed, kept = routed_buffers(tokens, experts, top_k)
        out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        held = [logits.to(DEVICE)]
        on_device = device_weight(form, held)
        torch.cuda.synchronize()
        launch_route(kernel_library, stream, routed, kept, held[0], router, None)
        moe.grouped_gemm(kernel_library, stream, d(out), d(x), on_device, routed, gather_div=top_k)
        stream.sync()
        outs.append(out.float().cpu()[kept[4].long().cpu()])      # by entry: an expert's rows are in no set order
    got, want = outs
    assert not got.isnan().any()
    if tile_rows >= 64:
        assert torch.equal(got, want)
    else:
        assert relative_error(got, want.double()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("softmax", [True, False])
def test_a_nan_logit_still_chooses_real_experts(kernel_library, stream, softmax):
    """NaN ranks above every number (as torch.topk ranks it; a softmax router's NaN makes its whole row NaN, as
    torch.softmax's): the token's choices stay distinct experts in range, so the grouping after them never writes
    outside its buffers, and they are torch's on the GPU."""
    logits = logits_for(4, 32, softmax, ties=False)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    router = MoeRouter(None, 4, "softmax" if softmax else "sigmoid", normalize=True)
    ids, _ = device_route(kernel_library, stream, logits, router, None)
    assert ((ids >= 0) & (ids < 32)).all() and all(len(set(row)) == 4 for row in ids.tolist())
    _, want_ids = choose(logits.to(DEVICE), router)
    assert torch.equal(ids.sort().values, want_ids.long().cpu().sort().values)
    assert (5 in ids[1].tolist()) != softmax and ids[2].tolist() == [0, 1, 2, 3]
