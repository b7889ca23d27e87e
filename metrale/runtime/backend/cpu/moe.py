"""Mixtures of experts in plain torch, as transformers computes them: the router's choice and weights, then each
expert over the tokens routed to it."""

import torch
import torch.nn.functional as F

from metrale.runtime.backend.layer_math import Experts, MoeRouter


def route(x: torch.Tensor, router: MoeRouter) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) of each token. Softmax routers take the logits in
    x's dtype (Mixtral, Qwen3-MoE) unless float32_logits (DeepSeek-V2), sigmoid routers in float32 (DeepSeek-V3)."""
    if router.scoring == "softmax" and not router.float32_logits:
        return choose(F.linear(x, router.weight).float(), router)
    return choose(F.linear(x.float(), router.weight.float()), router)


def choose(logits: torch.Tensor, router: MoeRouter) -> tuple[torch.Tensor, torch.Tensor]:
    """route() from the router's float32 logits [T, experts]."""
    scores = torch.softmax(logits, dim=-1) if router.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if router.correction_bias is None else scores + router.correction_bias
    if router.n_group > 1:
        groups = choice.view(choice.shape[0], router.n_group, -1)
        if router.group_score == "max":
            best = groups.max(dim=-1).values                                    # [T, n_group]
        else:
            best = groups.topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.zeros_like(best).scatter_(1, best.topk(router.topk_group, dim=-1)[1], 1.0).bool()
        choice = groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(router.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if router.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if router.scoring == "sigmoid" else 0.0))
    return weights * router.scaling, ids


def moe(x: torch.Tensor, router: MoeRouter, experts: Experts) -> torch.Tensor:
    weights, ids = route(x, router)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in ids.unique().tolist():
        tokens, k = torch.where(ids == expert)
        up = F.linear(x[tokens], experts.up[expert])
        if experts.activation == "silu":
            gate, up = up.chunk(2, dim=-1)
            if experts.limit:
                gate, up = gate.clamp(max=experts.limit), up.clamp(-experts.limit, experts.limit)
            activated = F.silu(gate) * up
        else:
            activated = F.relu(up).square()
        y = F.linear(activated, experts.down[expert])
        out.index_add_(0, tokens, y.float() * weights[tokens, k, None])
    return out.to(x.dtype)
