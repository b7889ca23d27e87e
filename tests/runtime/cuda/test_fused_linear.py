"""fused_linear.cu against torch: the residual linear (and the row statistics it leaves) and the norm linear that
reads them, over row counts that fill, split and overflow a 64-row tile, every K split, and NLLB-600M's shapes."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.kernels.fused_linear import (SPLITS, TILE_N, linear_norm,  # noqa: E402
                                                               linear_residual, plan_splits, splits_take)
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
ROWS = [1, 5, 64, 100, 256]
# (N, K): NLLB-600M's decoder linears (out, cross q and cross out; qkv; fc1; fc2), and a small odd one.
SHAPES = [(1024, 1024), (3072, 1024), (4096, 1024), (1024, 4096), (192, 128)]
EPS = 1e-5


def t(tensor):
    return DeviceTensor.from_torch(tensor)


def random(*shape, seed: int, scale: float = 1.0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator, device=DEVICE)).bfloat16()


def splits_of(m: int, n: int, k: int) -> list[int]:
    """Every split the kernel takes for K, the planned one first."""
    planned = plan_splits(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    return [planned] + [s for s in SPLITS if s != planned and splits_take(k, s)]


def run_residual(lib, stream, x, weight, bias, residual, splits):
    m, n = x.shape[0], weight.shape[0]
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    stats = torch.full((n // TILE_N, m, 2), float("nan"), device=DEVICE)
    torch.cuda.synchronize()
    linear_residual(lib, stream, t(out), t(x), t(weight), t(bias) if bias is not None else None, t(residual),
                    t(stats), splits)
    stream.sync()
    return out, stats


def reference_stats(out: torch.Tensor) -> torch.Tensor:
    """Per row and 64-column tile of out: the mean and the sum of squared deviations, in float64."""
    tiles = out.double().view(out.shape[0], -1, TILE_N).transpose(0, 1)      # [tiles, m, 64]
    mean = tiles.mean(dim=-1)
    return torch.stack([mean, ((tiles - mean.unsqueeze(-1)) ** 2).sum(dim=-1)], dim=-1)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_residual_linear_matches_torch(kernel_library, stream, m, n, k):
    x, weight, bias = random(m, k, seed=m), random(n, k, seed=n + k, scale=k ** -0.5), random(n, seed=7)
    residual = random(m, n, seed=3 * m + 1, scale=4.0)
    linear = (x.double() @ weight.double().T + bias.double()).bfloat16()
    reference = linear + residual                         # a bf16 torch add of the rounded linear
    first = None
    for splits in splits_of(m, n, k):
        out, stats = run_residual(kernel_library, stream, x, weight, bias, residual, splits)
        assert relative_error(out, reference) < TOLERANCE[torch.bfloat16] / 10, splits
        # Differs from the reference only where the fp32 sum rounds the linear to the neighbouring bf16.
        assert (out != reference).float().mean() < 0.02, splits
        expected = reference_stats(out)
        assert torch.allclose(stats.double(), expected, rtol=1e-4, atol=1e-4), splits
        if first is None:
            first = out
            again, _ = run_residual(kernel_library, stream, x, weight, bias, residual, splits)
            assert torch.equal(again, out)                # the splits meet in rank order: deterministic


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_norm_linear_matches_torch(kernel_library, stream, m, n, k, relu):
    # x and its statistics as the residual linear before leaves them, with an offset mean per row (the case a
    # sum of squares would lose digits on).
    h, w0 = random(m, 64, seed=m + 11), random(k, 64, seed=k + 13, scale=0.125)
    residual = (random(m, k, seed=m + 17, scale=3.0).float() + torch.arange(m, device=DEVICE)[:, None] * 0.5)
    x, stats = run_residual(kernel_library, stream, h, w0, None, residual.bfloat16(), splits_of(m, k, 64)[0])
    norm_weight, norm_bias = random(k, seed=19, scale=0.5), random(k, seed=23, scale=0.5)
    weight, bias = random(n, k, seed=n + 2 * k, scale=k ** -0.5), random(n, seed=29)
    normed = torch.nn.functional.layer_norm(x.float(), (k,), norm_weight.float(), norm_bias.float(), EPS)
    reference = normed.bfloat16().double() @ weight.double().T + bias.double()
    if relu:
        reference = reference.clamp(min=0)
    for splits in splits_of(m, n, k):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        torch.cuda.synchronize()
        linear_norm(kernel_library, stream, t(out), t(x), t(stats), t(norm_weight), t(norm_bias), EPS, t(weight),
                    t(bias), relu, splits)
        stream.sync()
        assert relative_error(out, reference) < TOLERANCE[torch.bfloat16] / 4, splits


def test_strided_x_and_out(kernel_library, stream):
    # qkv-style column slices: x a slice of a wider buffer, out a slice whose other columns keep their poison.
    m, n, k = 48, 1024, 1024
    x = random(m, k + 64, seed=1)[:, 32:32 + k]
    weight, residual = random(n, k, seed=2, scale=k ** -0.5), random(m, n, seed=3)
    out_wide = torch.full((m, n + 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = out_wide[:, :n]
    stats = torch.empty((n // TILE_N, m, 2), device=DEVICE)
    torch.cuda.synchronize()
    linear_residual(kernel_library, stream, t(out), t(x), t(weight), None, t(residual), t(stats), 4)
    stream.sync()
    reference = (x.double() @ weight.double().T).bfloat16() + residual
    assert relative_error(out, reference) < TOLERANCE[torch.bfloat16] / 10
    assert out_wide[:, n:].isnan().all()
