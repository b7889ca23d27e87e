"""How the GPU tests compare with a reference (METHOD.md): relative error in float64, per-dtype bounds."""

import torch

# fp32 well under 1e-3, bf16 under 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||, in float64; NaN or inf anywhere is an infinite error."""
    ours, reference = ours.double().cpu(), reference.double().cpu()
    if not torch.isfinite(ours).all():
        return float("inf")
    return float((ours - reference).norm() / reference.norm())
