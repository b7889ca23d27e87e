"""Manifold-constrained hyper-connections in plain torch, as transformers computes them (float32 throughout): a
block's input from the residual streams, the streams after it, and the head that collapses them."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale.runtime.backend.layer_math import HyperConnection, HyperHead


@dataclass(frozen=True)
class Mix:
    """What a block's hyper-connection hands to the streams after it: post [T, hc_mult] and comb [T, hc_mult,
    hc_mult] (None: the streams pass unmixed), float32."""
    post: torch.Tensor
    comb: torch.Tensor | None


def _logits(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fn's projection of each token's flattened streams over their RMS -> [T, rows] float32."""
    flat = streams.float()
    return F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def _weighted_sum(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over n of weights[:, n] * stream n -> [T, hidden] in the streams' dtype."""
    tokens, hc_mult = weights.shape
    split = streams.float().view(tokens, hc_mult, streams.shape[1] // hc_mult)
    return (weights.unsqueeze(-1) * split).sum(dim=1).to(streams.dtype)


def collapse(streams: torch.Tensor, hc: HyperConnection) -> tuple[torch.Tensor, Mix]:
    n = hc.hc_mult
    logits = _logits(streams, hc.fn, hc.norm_eps)
    pre = torch.sigmoid(logits[:, :n] * hc.scale[0] + hc.base[:n]) + hc.eps
    post = hc.post_magnitude * torch.sigmoid(logits[:, n:2 * n] * hc.scale[1] + hc.base[n:2 * n]) + hc.post_eps
    comb = None
    if hc.sinkhorn_iters:
        comb = torch.softmax((logits[:, 2 * n:] * hc.scale[2] + hc.base[2 * n:]).view(-1, n, n), dim=-1) + hc.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.eps)
        for _ in range(hc.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.eps)
    return _weighted_sum(streams, pre), Mix(post, comb)


def expand(out: torch.Tensor, streams: torch.Tensor, mix: Mix) -> torch.Tensor:
    tokens, hc_mult = mix.post.shape
    residual = streams.float().view(tokens, hc_mult, streams.shape[1] // hc_mult)
    if mix.comb is not None:
        residual = torch.einsum("tjk,tjd->tkd", mix.comb, residual)
    widened = mix.post.unsqueeze(-1) * out.float().unsqueeze(1) + residual
    return widened.view(tokens, streams.shape[1]).to(streams.dtype)


def head(streams: torch.Tensor, hc_head: HyperHead) -> torch.Tensor:
    logits = _logits(streams, hc_head.fn, hc_head.norm_eps)
    return _weighted_sum(streams, torch.sigmoid(logits * hc_head.scale[0] + hc_head.base) + hc_head.eps)
