"""Mamba2's conv and selective scan over each segment's recurrent state, in plain torch: one-token segments (decode)
all at once in the recurrent form, longer ones in chunks of the scan's chunk_size (the SSD form: within a chunk as a
masked attention-like product, across chunks through the carried state)."""

import torch
import torch.nn.functional as F

from metrale.runtime.backend.layer_math import SsmScan


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch, conv_state: torch.Tensor
         ) -> torch.Tensor:
    """LayerMath.ssm_conv. x [T, C]; weight [C, K]; conv_state [slots, C, K - 1] float32."""
    out = torch.empty_like(x)
    channels, width = weight.shape
    if batch.single_rows.numel():
        sources, destinations = batch.single_states
        before = _read(conv_state, sources).to(x.dtype)                           # [S, C, K - 1]
        window = torch.cat((before, x[batch.single_rows].unsqueeze(-1)), dim=-1)  # [S, C, K]
        y = (window * weight).sum(-1)
        out[batch.single_rows] = F.silu(y if bias is None else y + bias)
        conv_state[destinations] = window[:, :, 1:].float()
    for start, n, (source, destination) in batch.multi_states:
        before = _read(conv_state, torch.tensor([source]))[0].to(x.dtype)          # [C, K - 1]
        window = torch.cat((before, x[start:start + n].T), dim=-1)                 # [C, K - 1 + n]
        y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0]   # [C, n]
        out[start:start + n] = F.silu(y.T)
        conv_state[destination] = window[:, window.shape[1] - (width - 1):].float()
    return out


def scan(xbc: torch.Tensor, dt: torch.Tensor, p: SsmScan, batch, ssm_state: torch.Tensor) -> torch.Tensor:
    """LayerMath.ssm_scan. xbc [T, conv_size]; dt [T, heads]; ssm_state [slots, heads, head_dim, state_size]."""
    heads, head_dim, state_size = p.num_heads, p.head_dim, p.state_size
    x = xbc[:, :p.inner_size].float().view(-1, heads, head_dim)
    b, c = (_per_head(xbc[:, start:start + p.n_groups * state_size], p)
            for start in (p.inner_size, p.inner_size + p.n_groups * state_size))
    dt = (F.softplus(dt.float() + p.dt_bias)).clamp(p.dt_min, p.dt_max)         # [T, heads]
    y = torch.empty_like(x)
    if batch.single_rows.numel():
        rows = batch.single_rows
        sources, destinations = batch.single_states
        h, y[rows] = _step(_read(ssm_state, sources), x[rows], dt[rows], b[rows], c[rows], p.A)
        ssm_state[destinations] = h
    for start, n, (source, destination) in batch.multi_states:
        h = _read(ssm_state, torch.tensor([source]))[0]
        for chunk in range(0, n, p.chunk_size):
            span = slice(start + chunk, start + min(n, chunk + p.chunk_size))
            h, y[span] = _chunk(h, x[span], dt[span], b[span], c[span], p.A)
        ssm_state[destination] = h
    y = y + p.D[:, None] * x
    return y.reshape(xbc.shape[0], -1).to(xbc.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                   norm_before_gate: bool = False) -> torch.Tensor:
    """LayerMath.gated_rms_norm, as transformers' MambaRMSNormGated with the gate (norm after the gate), or
    FalconH1RMSNormGated with norm_before_gate."""
    h = x.float() if norm_before_gate else x.float() * F.silu(gate.float())
    grouped = h.view(*h.shape[:-1], -1, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    if norm_before_gate:
        return (weight.float() * grouped.view(h.shape) * F.silu(gate.float())).to(x.dtype)
    return weight * grouped.view(h.shape).to(x.dtype)


def _per_head(groups: torch.Tensor, p: SsmScan) -> torch.Tensor:
    """B or C [T, n_groups * state_size] -> [T, heads, state_size] float32, each head its group's."""
    per_group = groups.float().view(-1, p.n_groups, p.state_size)
    return per_group.repeat_interleave(p.num_heads // p.n_groups, dim=1)


def _read(state: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """The states at the source slots, zeros where a source is -1 (a new sequence)."""
    read = state[sources.clamp(min=0)]
    return torch.where((sources >= 0).view(-1, *[1] * (state.dim() - 1)), read, 0.0)


def _step(h, x, dt, b, c, A):
    """One token per row: h [S, H, P, N], x [S, H, P], dt [S, H], b/c [S, H, N] -> (h after, y [S, H, P])."""
    decay = torch.exp(dt * A)                                                    # [S, H]
    h = h * decay[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    return h, torch.einsum("shpn,shn->shp", h, c)


def _chunk(h, x, dt, b, c, A):
    """The tokens of one chunk of one sequence after state h [H, P, N]: x [q, H, P], dt [q, H], b/c [q, H, N]
    -> (h after the chunk, y [q, H, P] without the D skip)."""
    q = x.shape[0]
    a = dt * A                                                                   # [q, H], log-decay of each token
    # decay_to[l, s] = exp(a[s + 1] + ... + a[l]) for s <= l, else 0: summed as masked prefix sums (no difference
    # of two long cumulative sums, which would cancel).
    later = torch.triu(torch.ones(q, q, dtype=torch.bool), diagonal=1)           # [s, k]: k > s
    sums = torch.where(later[..., None], a[None, :, :], 0.0).cumsum(dim=1)       # [s, l, H]
    decay_to = torch.exp(sums.transpose(0, 1)).masked_fill(later[..., None], 0.0)     # [l, s, H]
    xdt = x * dt[..., None]                                                      # [q, H, P]
    scores = torch.einsum("lhn,shn->lsh", c, b) * decay_to
    y = torch.einsum("lsh,shp->lhp", scores, xdt)
    y = y + torch.exp(a.cumsum(0))[..., None] * torch.einsum("lhn,hpn->lhp", c, h)
    to_end = decay_to[q - 1]                                                     # [s, H]
    h = torch.exp(a.sum(0))[:, None, None] * h + torch.einsum("shn,shp,sh->hpn", b, xdt, to_end)
    return h, y
