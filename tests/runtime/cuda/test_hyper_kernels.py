"""hyper.cu against cpu/hyper.py on the same bf16 streams: widen, collapse, expand, the fused block boundary (in
place) and the head, in Hy4's form (no comb, post_eps = eps) and DeepSeek-V4's (a 20-iteration Sinkhorn comb), at
Hy4's hidden size and a small one, for one token, a few and a prefill's; with a scratch (a few tokens' rows in pieces,
a CTA each) and without (a CTA a token)."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cpu import hyper as reference  # noqa: E402
from metrale.runtime.backend.cuda.kernels import hyper  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.backend.layer_math import HyperConnection, HyperHead, RmsNorm  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
HC_MULT, NORM_EPS, EPS = 4, 1e-6, 1e-6
FORMS = {"hy4": dict(post_magnitude=2.0, post_eps=EPS, sinkhorn_iters=0),
         "deepseek_v4": dict(post_magnitude=2.0, post_eps=0.0, sinkhorn_iters=20)}
SHAPES = [(hidden, tokens) for hidden in (64, 2816) for tokens in (1, 7, 300)]
PAD = 8                                   # streams' row stride past their width (16 bytes)
d = DeviceTensor.from_torch


def projection(rows: int, hidden: int, scales: int, seed: int) -> tuple[torch.Tensor, ...]:
    """fn, base, scale (float32) whose logits land where the sigmoids and the softmax still bend."""
    generator, width = torch.Generator().manual_seed(seed), HC_MULT * hidden
    fn = torch.randn(rows, width, generator=generator) * (2.0 / width ** 0.5)
    return fn, torch.randn(rows, generator=generator) * 0.7, 0.5 + torch.rand(scales, generator=generator)


def connection(form: str, hidden: int, seed: int) -> tuple[HyperConnection, HyperConnection, list]:
    """The same connection on the CPU and on the GPU (device tensors, whose torch tensors the list holds)."""
    kinds = FORMS[form]
    comb = bool(kinds["sinkhorn_iters"])
    weights = projection(2 * HC_MULT + (HC_MULT ** 2 if comb else 0), hidden, 3 if comb else 2, seed)
    held = [w.to(DEVICE) for w in weights]
    return (HyperConnection(*weights, HC_MULT, NORM_EPS, EPS, **kinds),
            HyperConnection(*(d(w) for w in held), HC_MULT, NORM_EPS, EPS, **kinds), held)


def padded_streams(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """Random bf16 streams [T, hc_mult * hidden], rows PAD elements apart past their width (on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HC_MULT * hidden + PAD, generator=generator).bfloat16()


def random_rows(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()


def mix_of(hc: HyperConnection, tokens: int, hidden: int, seed: int) -> reference.Mix:
    """A mix as a block's collapse gives it (the reference's, on random streams)."""
    return reference.collapse(padded_streams(tokens, hidden, seed)[:, :HC_MULT * hidden], hc)[1]


def mix_on_gpu(mix: reference.Mix) -> tuple[torch.Tensor, torch.Tensor | None]:
    """post [T, hc_mult], comb [T, hc_mult^2] (or None), float32 on the GPU."""
    comb = None if mix.comb is None else mix.comb.reshape(mix.comb.shape[0], -1).contiguous().to(DEVICE)
    return mix.post.contiguous().to(DEVICE), comb


def assert_mix_close(post: torch.Tensor, comb: torch.Tensor | None, want: reference.Mix) -> None:
    assert relative_error(post.cpu(), want.post) < TOLERANCE[torch.float32]
    assert (comb is None) == (want.comb is None)
    if comb is not None:
        assert relative_error(comb.cpu().view_as(want.comb), want.comb) < TOLERANCE[torch.float32]


@pytest.fixture(params=["pieces", "whole rows"])
def scratch(request):
    """A scratch where a few tokens' pieces meet (checked back at zero arrivals after the test), or None."""
    if request.param == "whole rows":
        yield None
        return
    partials = torch.full((hyper.PIECE_CTAS * (hyper.MAX_ROWS + 1),), float("nan"), device=DEVICE)
    arrivals = torch.zeros(hyper.PIECE_CTAS // 2, dtype=torch.int32, device=DEVICE)
    yield hyper.Scratch(d(partials), d(arrivals))
    torch.cuda.synchronize()
    assert not arrivals.any()           # each token's last piece resets its count


def nothing(*tensors) -> None:
    """Fills the outputs with NaN, so a value the kernel leaves unwritten fails the comparison."""
    for tensor in tensors:
        if tensor is not None:
            tensor.fill_(float("nan"))


@pytest.mark.parametrize("hidden, tokens", SHAPES)
def test_widen_copies_x_into_every_stream(kernel_library, stream, hidden, tokens):
    x = random_rows(tokens, hidden, seed=1)
    streams = torch.full((tokens, HC_MULT * hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    x_gpu = x.to(DEVICE)
    torch.cuda.synchronize()
    hyper.widen(kernel_library, stream, d(streams), d(x_gpu), HC_MULT)
    stream.sync()
    assert torch.equal(streams.cpu(), x.repeat(1, HC_MULT))


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("hidden, tokens", SHAPES)
def test_collapse_matches_the_reference(kernel_library, stream, scratch, form, hidden, tokens):
    hc, hc_gpu, _held = connection(form, hidden, seed=2)
    padded = padded_streams(tokens, hidden, seed=3)
    streams = padded[:, :HC_MULT * hidden]
    want_x, want_mix = reference.collapse(streams, hc)
    padded_gpu = padded.to(DEVICE)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    post = torch.empty(tokens, HC_MULT, device=DEVICE)
    comb = torch.empty(tokens, HC_MULT ** 2, device=DEVICE) if hc.sinkhorn_iters else None
    nothing(x, post, comb)
    torch.cuda.synchronize()
    hyper.collapse(kernel_library, stream, d(x), d(post), comb if comb is None else d(comb),
                   d(padded_gpu[:, :HC_MULT * hidden]), hc_gpu, scratch)
    stream.sync()
    assert relative_error(x.cpu(), want_x) < TOLERANCE[torch.bfloat16]
    assert_mix_close(post, comb, want_mix)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("hidden, tokens", SHAPES)
def test_expand_matches_the_reference(kernel_library, stream, form, hidden, tokens):
    hc, _, _ = connection(form, hidden, seed=4)
    mix = mix_of(hc, tokens, hidden, seed=5)
    streams, out = padded_streams(tokens, hidden, seed=6)[:, :HC_MULT * hidden], random_rows(tokens, hidden, seed=7)
    want = reference.expand(out, streams, mix)
    streams_gpu, out_gpu = streams.contiguous().to(DEVICE), out.to(DEVICE)
    post, comb = mix_on_gpu(mix)
    new_streams = torch.empty_like(streams_gpu)
    nothing(new_streams)
    torch.cuda.synchronize()
    hyper.expand(kernel_library, stream, d(new_streams), d(out_gpu), d(streams_gpu), d(post),
                 comb if comb is None else d(comb))
    stream.sync()
    assert relative_error(new_streams.cpu(), want) < TOLERANCE[torch.bfloat16]
    assert torch.equal(streams_gpu.cpu(), streams)           # read only


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("hidden, tokens", SHAPES)
def test_boundary_is_expand_then_the_next_collapse_in_place(kernel_library, stream, scratch, form, hidden, tokens):
    hc, _, _ = connection(form, hidden, seed=8)
    next_hc, next_gpu, _held = connection(form, hidden, seed=9)
    mix = mix_of(hc, tokens, hidden, seed=10)
    padded, out = padded_streams(tokens, hidden, seed=11), random_rows(tokens, hidden, seed=12)
    width = HC_MULT * hidden
    want_streams = reference.expand(out, padded[:, :width], mix)
    want_x, want_mix = reference.collapse(want_streams, next_hc)
    padded_gpu, out_gpu = padded.to(DEVICE), out.to(DEVICE)
    post, comb = mix_on_gpu(mix)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    nothing(x)
    torch.cuda.synchronize()
    hyper.boundary(kernel_library, stream, d(x), d(padded_gpu[:, :width]), d(post), comb if comb is None else d(comb),
                   d(out_gpu), next_gpu, scratch)
    stream.sync()
    assert relative_error(padded_gpu[:, :width].cpu(), want_streams) < TOLERANCE[torch.bfloat16]
    assert torch.equal(padded_gpu[:, width:].cpu(), padded[:, width:])      # the padding untouched
    assert relative_error(x.cpu(), want_x) < TOLERANCE[torch.bfloat16]
    assert_mix_close(post, comb, want_mix)


def test_boundary_collapses_the_streams_as_bf16_holds_them(kernel_library, stream, scratch):
    """The collapse after the expand reads the streams rounded to bf16: the kernel's mix is the CPU's collapse of the
    very streams the kernel wrote to fp32's tolerance (the unrounded streams move the logits by about 1e-3)."""
    hidden, tokens = 2816, 7
    hc, _, _ = connection("deepseek_v4", hidden, seed=13)
    next_hc, next_gpu, _held = connection("deepseek_v4", hidden, seed=14)
    mix = mix_of(hc, tokens, hidden, seed=15)
    streams = padded_streams(tokens, hidden, seed=16)[:, :HC_MULT * hidden].contiguous().to(DEVICE)
    out = random_rows(tokens, hidden, seed=17).to(DEVICE)
    post, comb = mix_on_gpu(mix)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    torch.cuda.synchronize()
    hyper.boundary(kernel_library, stream, d(x), d(streams), d(post), d(comb), d(out), next_gpu, scratch)
    stream.sync()
    want_x, want_mix = reference.collapse(streams.cpu(), next_hc)
    assert relative_error(x.cpu(), want_x) < 1e-3
    assert_mix_close(post, comb, want_mix)


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of bf16 x (cpu/layer_math.py's)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_boundary_and_head_norm_what_they_collapse(kernel_library, stream, scratch, form, tokens):
    """The norm after a collapse (the next block's input norm, the final norm) fused into the kernel: the reference's
    collapse then RMSNorm."""
    hidden, eps = 2816, 1e-5
    hc, _, _ = connection(form, hidden, seed=20)
    next_hc, next_gpu, _held = connection(form, hidden, seed=21)
    head_weights = projection(HC_MULT, hidden, 1, seed=22)
    head_held = [w.to(DEVICE) for w in head_weights]
    weight = (1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(23))).bfloat16()
    mix = mix_of(hc, tokens, hidden, seed=24)
    streams, out = padded_streams(tokens, hidden, seed=25)[:, :HC_MULT * hidden], random_rows(tokens, hidden, 26)
    want_streams = reference.expand(out, streams, mix)
    want_x = rms_normed(reference.collapse(want_streams, next_hc)[0], weight, eps)
    want_head = rms_normed(reference.head(want_streams, HyperHead(*head_weights, HC_MULT, NORM_EPS, EPS)), weight, eps)
    streams_gpu, out_gpu, weight_gpu = streams.contiguous().to(DEVICE), out.to(DEVICE), weight.to(DEVICE)
    post, comb = mix_on_gpu(mix)
    x, head_x = (torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    nothing(x, head_x)
    norm = RmsNorm(d(weight_gpu), eps)
    torch.cuda.synchronize()
    hyper.boundary(kernel_library, stream, d(x), d(streams_gpu), d(post), comb if comb is None else d(comb),
                   d(out_gpu), next_gpu, scratch, norm)
    hyper.head(kernel_library, stream, d(head_x), d(streams_gpu),
               HyperHead(*(d(w) for w in head_held), HC_MULT, NORM_EPS, EPS), scratch, norm)
    stream.sync()
    assert relative_error(x.cpu(), want_x) < TOLERANCE[torch.bfloat16]
    assert relative_error(head_x.cpu(), want_head) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("hidden, tokens", SHAPES)
def test_head_matches_the_reference(kernel_library, stream, scratch, hidden, tokens):
    weights = projection(HC_MULT, hidden, 1, seed=18)
    held = [w.to(DEVICE) for w in weights]
    padded = padded_streams(tokens, hidden, seed=19)
    width = HC_MULT * hidden
    want = reference.head(padded[:, :width], HyperHead(*weights, HC_MULT, NORM_EPS, EPS))
    padded_gpu = padded.to(DEVICE)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    nothing(x)
    torch.cuda.synchronize()
    hyper.head(kernel_library, stream, d(x), d(padded_gpu[:, :width]),
               HyperHead(*(d(w) for w in held), HC_MULT, NORM_EPS, EPS), scratch)
    stream.sync()
    assert relative_error(x.cpu(), want) < TOLERANCE[torch.bfloat16]
