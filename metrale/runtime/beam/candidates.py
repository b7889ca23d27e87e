"""A beam step's candidates as a backend hands them over (Ops.beam_candidates): left where they were computed until
the host asks for them. The host search reads every step's; a device search seeds its state from the prompt pass's
without a copy back, so the host never waits between the prompt pass and the first search step."""

from dataclasses import dataclass
from typing import Protocol

import torch



class Candidates(Protocol):
    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """values [N, count] float32 and ids [N, count] int64, each row best first; waits for them the first time."""


@dataclass
class HostCandidates:
    """Candidates computed on the host (the CPU backend): already there."""
    values: torch.Tensor
    ids: torch.Tensor

    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.values, self.ids


def best_first(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(values, k) along the last dim with ties to the lower index, as the CUDA kernels rank (torch leaves
    the order of equal values open, and bf16 logits tie often): the values and their indices, best first."""
    if bool(torch.isnan(values).any()):     # torch ranks NaN first; finite() refuses such rows
        return tuple(torch.topk(values, k, dim=-1))
    kth = torch.topk(values, k, dim=-1).values[..., -1:]
    above, level = values > kth, values == kth
    # every value above the k-th, then the lowest-indexed of those equal to it until k are taken
    taken = above | (level & (level.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    indices = taken.nonzero()[:, -1].reshape(*values.shape[:-1], k)
    order = torch.sort(values.gather(-1, indices), dim=-1, descending=True, stable=True)
    return order.values, indices.gather(-1, order.indices)


def rows_of(found: list[tuple[Candidates, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """values, ids [len(found), count]: row `row` of each (candidates, row), as the host reads them."""
    rows = [tuple(part[row] for part in candidates.host()) for candidates, row in found]
    return torch.stack([v for v, _ in rows]), torch.stack([i for _, i in rows])


def finite(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's candidates, refused where a logits row had NaN or no finite maximum (the backend's id -1, or NaN
    log-probabilities): there is nothing to rank, as the sampler finds nothing to sample."""
    if bool((ids < 0).any()) or bool(torch.isnan(values).any()):
        raise ValueError("a logits row has no finite maximum (NaN or +inf logits): no beam to continue")
    return values, ids
