"""DeepSeek sparse attention's indexer in plain torch, as transformers computes it: each token's index key cached,
each query's scores over its causal context, and the top-k tokens it may attend to."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale.runtime.backend.layer_math import RopeTable, SparseIndexer


@dataclass(frozen=True)
class Selection:
    """Which cached tokens each query attends to, as CpuBatch lays the queries out: single [B, C] for the one-token
    segments (over the padded contexts), multi[i] [n, context] for each longer segment."""
    single: torch.Tensor
    multi: list[torch.Tensor]


def select(q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, indexer: SparseIndexer, rope: RopeTable, batch,
           cache: torch.Tensor, rotate) -> Selection:
    """LayerMath.sparse_select; rotate(x [T, heads, dims], cos, sin) is the backend's rotate-half."""
    tokens, heads, dim = q.shape[0], indexer.num_heads, indexer.head_dim
    cos, sin = batch.rope_at_positions(rope)
    q = _rotated(q.view(tokens, heads, dim), indexer, cos, sin, rotate).float()
    k = _rotated(k.view(tokens, 1, dim), indexer, cos, sin, rotate).view(tokens, dim)
    cache.view(-1, dim)[batch.slot_mapping] = k
    weights = F.linear(x.float(), indexer.weights_proj) * indexer.weight_scale           # [T, heads]
    single = torch.zeros(0, 0, dtype=torch.bool)
    if batch.single_rows.numel():
        keys = cache[batch.single_tables].flatten(1, 2)[:, :batch.single_context].float()   # [B, C, dim]
        rows = batch.single_rows
        scores = torch.einsum("bh,bhc->bc", weights[rows], F.relu(torch.einsum("bhd,bcd->bhc", q[rows], keys)))
        single = _top(scores, batch.single_allowed(None), indexer.topk)
    multi = []
    for start, n, context, table in batch.multi_segments:
        keys = cache[table].reshape(-1, dim)[:context].float()                              # [C, dim]
        rows = slice(start, start + n)
        scores = torch.einsum("nh,nhc->nc", weights[rows], F.relu(torch.einsum("nhd,cd->nhc", q[rows], keys)))
        multi.append(_top(scores, batch.causal_mask(n, context), indexer.topk))
    return Selection(single, multi)


def _rotated(x: torch.Tensor, indexer: SparseIndexer, cos, sin, rotate) -> torch.Tensor:
    """x [T, heads, head_dim] with its rotary part (the first or the last rope_dim) rotated."""
    rope = indexer.rope_dim
    if indexer.rope_first:
        return torch.cat([rotate(x[..., :rope], cos, sin), x[..., rope:]], dim=-1)
    return torch.cat([x[..., :-rope], rotate(x[..., -rope:], cos, sin)], dim=-1)


def _top(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """[rows, C] bool: each row's topk highest scores among its allowed tokens (every allowed one where fewer)."""
    if scores.shape[1] <= topk:
        return allowed
    scores = scores.masked_fill(~allowed, float("-inf"))
    chosen = torch.zeros_like(allowed).scatter_(1, scores.topk(topk, dim=-1).indices, True)
    return chosen & allowed
