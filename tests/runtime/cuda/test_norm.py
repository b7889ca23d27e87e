"""norm.cu against torch: RMSNorm and LayerNorm with and without the fused residual add, and per-head RMSNorm
(Qwen3 q/k)."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.kernels.embedding import gather_rows  # noqa: E402
from metrale.runtime.backend.cuda.kernels.norm import (head_rms_norm, layer_norm, layer_norm_gathered,  # noqa: E402
                                                       layer_norm_partials, rms_norm)
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
EPS = 1e-6


def poisoned(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 over the last dimension of bf16 x."""
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm in bf16: fp32 variance, normalised value rounded to bf16, then times the bf16 weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def inputs(num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).bfloat16()
    return x, weight


def wrap(*tensors):
    return [None if t is None else DeviceTensor.from_torch(t) for t in tensors]


# hidden 24: fewer units than a warp; 16384 and 32768: several 16-byte units per thread.
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [24, 64, 4096, 5120, 16384, 32768])
def test_rms_norm_with_residual(kernel_library, stream, num_tokens, hidden):
    x, weight = inputs(num_tokens, hidden)
    residual = (4 * torch.randn(num_tokens, hidden, device=DEVICE)).bfloat16()
    out, residual_out = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    torch.cuda.synchronize()
    rms_norm(kernel_library, stream, *wrap(out, x, weight), EPS, *wrap(residual, residual_out))
    stream.sync()
    added = x + residual   # a bf16 torch add: fp32 sum, rounded once
    assert torch.equal(residual_out, added)
    assert relative_error(residual_out, x.double() + residual.double()) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, reference_rms_norm(added, weight, EPS)) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, transformers_rms_norm(added, weight, EPS)) < 1e-3


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 4096, 8192])
@pytest.mark.parametrize("copy_residual", [False, True])
def test_rms_norm_without_residual(kernel_library, stream, num_tokens, hidden, copy_residual):
    x, weight = inputs(num_tokens, hidden)
    out = poisoned(num_tokens, hidden)
    residual_out = poisoned(num_tokens, hidden) if copy_residual else None
    torch.cuda.synchronize()
    rms_norm(kernel_library, stream, *wrap(out, x, weight), EPS, None, *wrap(residual_out))
    stream.sync()
    assert relative_error(out, reference_rms_norm(x, weight, EPS)) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, transformers_rms_norm(x, weight, EPS)) < 1e-3
    if copy_residual:
        assert torch.equal(residual_out, x)


def test_rms_norm_in_place_residual_and_strided_x(kernel_library, stream):
    # residual_out is residual itself (the decoder's running residual); x a column slice of a wider buffer.
    num_tokens, hidden = 33, 2048
    x = torch.randn(num_tokens, hidden + 64, device=DEVICE).bfloat16()[:, 32:32 + hidden]
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).bfloat16()
    residual = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    added = x + residual
    out = poisoned(num_tokens, hidden)
    torch.cuda.synchronize()
    rms_norm(kernel_library, stream, *wrap(out, x, weight), EPS, *wrap(residual, residual))
    stream.sync()
    assert torch.equal(residual, added)
    assert relative_error(out, reference_rms_norm(added, weight, EPS)) < TOLERANCE[torch.bfloat16]


# (heads, kv heads, head_dim): the tiny test model, Qwen3-8B, a 64-dim and a 256-dim head.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (32, 8, 128), (16, 16, 64), (8, 4, 256)])
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_head_rms_norm_on_q_and_k_slices_of_qkv(kernel_library, stream, num_heads, num_kv_heads, head_dim, num_tokens):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE).bfloat16()
    original = qkv.clone()
    q_weight = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).bfloat16()
    k_weight = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).bfloat16()
    torch.cuda.synchronize()
    head_rms_norm(kernel_library, stream, DeviceTensor.from_torch(qkv[:, :q_size]), DeviceTensor.from_torch(q_weight),
                  EPS, head_dim)
    head_rms_norm(kernel_library, stream, DeviceTensor.from_torch(qkv[:, q_size:q_size + kv_size]),
                  DeviceTensor.from_torch(k_weight), EPS, head_dim)
    stream.sync()
    for start, size, weight in ((0, q_size, q_weight), (q_size, kv_size, k_weight)):
        heads = original[:, start:start + size].view(num_tokens, -1, head_dim)
        ours = qkv[:, start:start + size].reshape(num_tokens, -1, head_dim)
        assert relative_error(ours, reference_rms_norm(heads, weight, EPS)) < TOLERANCE[torch.bfloat16]
        assert relative_error(ours, transformers_rms_norm(heads, weight, EPS)) < 1e-3
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:])


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [24, 1024, 4096, 32768])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_matches_float64_and_torch(kernel_library, stream, num_tokens, hidden, with_residual):
    x, weight = inputs(num_tokens, hidden)
    x = x + 3     # a mean far from zero: the centring matters
    bias = (0.5 * torch.randn(hidden, device=DEVICE)).bfloat16()
    residual = (4 * torch.randn(num_tokens, hidden, device=DEVICE)).bfloat16() if with_residual else None
    out, residual_out = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    torch.cuda.synchronize()
    layer_norm(kernel_library, stream, *wrap(out, x, weight, bias), 1e-5, *wrap(residual, residual_out))
    stream.sync()
    added = x + residual if with_residual else x
    assert torch.equal(residual_out, added)
    exact = torch.nn.functional.layer_norm(added.double(), (hidden,), weight.double(), bias.double(), 1e-5)
    assert relative_error(out, exact) < TOLERANCE[torch.bfloat16]
    ours_vs_torch = relative_error(out, torch.nn.functional.layer_norm(added, (hidden,), weight, bias, 1e-5))
    assert ours_vs_torch < 1e-2


@pytest.mark.parametrize("num_tokens, hidden", [(1, 1024), (64, 1024), (7, 24), (300, 4096)])
def test_layer_norm_gathered_is_two_gathers_then_the_norm(kernel_library, stream, num_tokens, hidden):
    """The embedding layer's lookups gathered by the norm: the same bits as gather_rows twice then layer_norm (the
    launches it replaces), over column slices of wider tables and with indices outside a table (a zero row), and
    against float64."""
    vocab, positions = 1000, 40
    x_table = torch.randn(vocab, hidden + 8, device=DEVICE).bfloat16()[:, 8:]
    residual_table = (4 * torch.randn(positions, hidden, device=DEVICE)).bfloat16()
    x_rows = torch.randint(0, vocab, (num_tokens,), dtype=torch.int32, device=DEVICE)
    residual_rows = torch.randint(0, positions, (num_tokens,), dtype=torch.int32, device=DEVICE)
    x_rows[::5], residual_rows[2::7] = vocab, -1                 # outside: zero rows
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).bfloat16()
    bias = (0.5 * torch.randn(hidden, device=DEVICE)).bfloat16()
    out, residual_out = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    x, residual = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    plain_out, plain_residual_out = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    torch.cuda.synchronize()
    layer_norm_gathered(kernel_library, stream, *wrap(out, residual_out, x_table, x_rows, residual_table,
                                                      residual_rows, weight, bias), 1e-5)
    gather_rows(kernel_library, stream, *wrap(x, x_table, x_rows))
    gather_rows(kernel_library, stream, *wrap(residual, residual_table, residual_rows))
    layer_norm(kernel_library, stream, *wrap(plain_out, x, weight, bias), 1e-5, *wrap(residual, plain_residual_out))
    stream.sync()
    assert torch.equal(residual_out, plain_residual_out) and torch.equal(out, plain_out)
    assert not out.isnan().any() and (x[::5] == 0).all() and (residual[2::7] == 0).all()
    added = x.double() + residual.double()
    exact = torch.nn.functional.layer_norm(added, (hidden,), weight.double(), bias.double(), 1e-5)
    assert relative_error(out, exact) < TOLERANCE[torch.bfloat16]


# hidden 12288: more units than layer_norm_partials' blocks (~480 threads, by its registers) hold one each.
@pytest.mark.parametrize("num_tokens, hidden, splits", [(1, 1024, 4), (64, 1024, 8), (7, 24, 2), (33, 4096, 1),
                                                      (3, 12288, 4)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_partials_sums_a_linears_slices(kernel_library, stream, num_tokens, hidden, splits, with_bias):
    """A linear's split-K partials summed in fp32 with its bias and rounded to bf16 (the linear's bf16 output, as
    cuBLASLt's bias epilogue rounds it), added to the residual in bf16, then LayerNorm: against the same steps in
    torch, and the float64 norm."""
    partials = torch.randn(splits, num_tokens, hidden, device=DEVICE) * 2 + 1
    linear_bias = (0.5 * torch.randn(hidden, device=DEVICE)).bfloat16() if with_bias else None
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).bfloat16()
    bias = (0.5 * torch.randn(hidden, device=DEVICE)).bfloat16()
    residual = (4 * torch.randn(num_tokens, hidden, device=DEVICE)).bfloat16()
    out, residual_out = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    torch.cuda.synchronize()
    layer_norm_partials(kernel_library, stream, *wrap(out, partials.reshape(splits * num_tokens, hidden)), splits,
                        *wrap(linear_bias, weight, bias), 1e-5, *wrap(residual, residual_out))
    stream.sync()
    summed = partials[0].clone()
    for s in range(1, splits):
        summed += partials[s]
    linear_out = (summed + (linear_bias.float() if with_bias else 0)).bfloat16()
    added = linear_out + residual
    assert torch.equal(residual_out, added)
    exact = torch.nn.functional.layer_norm(added.double(), (hidden,), weight.double(), bias.double(), 1e-5)
    assert relative_error(out, exact) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, torch.nn.functional.layer_norm(added, (hidden,), weight, bias, 1e-5)) < 1e-2
