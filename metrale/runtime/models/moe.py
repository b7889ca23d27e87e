"""A decoder's mixture-of-experts MLP: which layers have one, its router and experts as config.json describes them,
and their tensors read from a checkpoint (each expert's own, as released, or transformers 5's stacked ones)."""

from dataclasses import dataclass
from typing import Callable

import torch

from metrale.runtime.backend.layer_math import Experts, LayerMath, MoeRouter
from metrale.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    width: int                          # each expert's intermediate size
    layers: tuple[int, ...]             # the layers whose MLP is this mixture (the others: a dense MLP)
    scoring: str = "softmax"            # MoeRouter's
    normalize: bool = True
    correction_bias: bool = False       # the router has e_score_correction_bias
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    shared_width: int = 0               # the shared experts' MLP width, added to every token's (0: none)
    module: str = "mlp"                 # the layer's module in the checkpoint
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")   # each expert's gate, up, down

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise InvalidArgument(f"num_experts_per_tok {self.top_k} must be in 1..{self.num_experts}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise InvalidArgument(f"router scoring {self.scoring!r} is not supported (softmax, sigmoid are)")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise InvalidArgument(f"n_group {self.n_group} must divide {self.num_experts} experts and topk_group "
                                  f"{self.topk_group} be in 1..{self.n_group}")
        if self.n_group > 1 and (self.num_experts // self.n_group < 2
                                 or self.top_k > self.topk_group * self.num_experts // self.n_group):
            raise InvalidArgument(f"top-{self.top_k} over {self.topk_group} of {self.n_group} groups of "
                                  f"{self.num_experts // self.n_group} experts cannot be chosen")


def load_moe(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str, moe: MoeConfig,
             ops: LayerMath) -> dict:
    """Layer `prefix`'s mixture, uploaded: "router" (MoeRouter), "experts" (Experts) and, with shared experts,
    "shared.gate_up_proj" and "shared.down_proj". One layer's experts are on the host at a time."""
    module = prefix + moe.module + "."
    correction = ops.upload_float32(take(module + "gate.e_score_correction_bias")) if moe.correction_bias else None
    router = MoeRouter(ops.upload(take(module + "gate.weight")), moe.top_k, moe.scoring, moe.normalize, correction,
                       moe.n_group, moe.topk_group, moe.scaling)
    if has(module + "experts.gate_up_proj"):          # transformers 5's stacked experts
        gate_up, down = take(module + "experts.gate_up_proj"), take(module + "experts.down_proj")
    else:
        gate, up, down_name = moe.expert_names
        expert = lambda e, name: take(f"{module}experts.{e}.{name}.weight")  # noqa: E731
        gate_up = torch.stack([torch.cat([expert(e, gate), expert(e, up)]) for e in range(moe.num_experts)])
        down = torch.stack([expert(e, down_name) for e in range(moe.num_experts)])
    layer = {"router": router, "experts": Experts(ops.upload(gate_up), ops.upload(down))}
    if moe.shared_width:
        shared = module + "shared_experts."
        layer["shared.gate_up_proj"] = ops.upload(torch.cat([take(shared + "gate_proj.weight"),
                                                             take(shared + "up_proj.weight")]))
        layer["shared.down_proj"] = ops.upload(take(shared + "down_proj.weight"))
    return layer
