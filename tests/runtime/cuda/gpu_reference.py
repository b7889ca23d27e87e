"""How the GPU tests compare with a reference (METHOD.md): relative error in float64, per-dtype bounds; and the
linear tests' inputs (random x, NaN-poisoned outputs)."""

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# fp32 well under 1e-3, bf16 under 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||, in float64; NaN or inf anywhere is an infinite error."""
    ours, reference = ours.double().cpu(), reference.double().cpu()
    if not torch.isfinite(ours).all():
        return float("inf")
    return float((ours - reference).norm() / reference.norm())


def random_x(m: int, k: int, seed: int, pad: int = 0) -> torch.Tensor:
    """bf16 [M, K], never zeros; with pad, a column slice at column pad of a [M, K + 2 pad] buffer."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(m, k + 2 * pad, generator=generator, device="cuda").to(torch.bfloat16)
    return wide[:, pad:pad + k]


def poisoned(m: int, n: int, dtype: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, N], the [M, N + 2 pad] buffer it is a column slice of), all NaN."""
    wide = torch.full((m, n + 2 * pad), float("nan"), dtype=DTYPES[dtype], device="cuda")
    return wide[:, pad:pad + n], wide
