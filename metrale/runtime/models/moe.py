"""A decoder's mixture-of-experts MLP: which layers have one, its router and experts as config.json describes them,
and their tensors read from a checkpoint (each expert's own, as released, or transformers 5's stacked ones)."""

from dataclasses import dataclass, replace
from typing import Callable

import torch

from metrale.runtime.backend.layer_math import LayerMath, MoeRouter
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS, Segments


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
    group_score: str = "top2"           # MoeRouter's
    float32_logits: bool = False
    shared_width: int = 0               # the shared experts' MLP width, added to every token's (0: none)
    activation: str = "silu"            # Experts': "silu" (gated) or "relu2"; the shared experts' too
    module: str = "mlp"                 # the layer's module in the checkpoint
    stacked_module: str | None = None   # its name where transformers 5 saved the experts stacked, if not module
    # Each expert's (and the shared experts') gate, up and down projections; no gate where not gated.
    expert_names: tuple[str | None, str, str] = ("gate_proj", "up_proj", "down_proj")
    limit: float = 0.0                  # the routed experts' SwiGLU clamp (Experts.limit; Hy4's swiglu_limit)

    def activation_width(self, hidden: int) -> int:
        """Activation elements (bf16-sized) a token of one mixture layer's forward takes beyond the dense layers':
        its router logits (float32, each row padded to 16 bytes), its entries' ids, weights, rows and tiles
        (32-bit), the experts' up, activated and output rows, the offsets and partial tiles of every expert
        (counted per token: a forward has at least one), and the shared experts' MLP."""
        logits = 2 * (-(-self.num_experts // 4) * 4)
        routed = logits + self.top_k * (2 * 6 + 3 * self.width + hidden) + 2 * 3 * (self.num_experts + 1)
        return routed + 3 * self.shared_width + hidden

    @property
    def gated(self) -> bool:
        return self.activation == "silu"

    def router(self, weight, correction_bias=None) -> MoeRouter:
        """The layer math's router over an uploaded weight (and correction bias, where the router has one)."""
        return MoeRouter(weight, self.top_k, self.scoring, self.normalize, correction_bias, self.n_group,
                         self.topk_group, self.scaling, self.group_score, self.float32_logits)

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise InvalidArgument(f"num_experts_per_tok {self.top_k} must be in 1..{self.num_experts}")
        if self.activation not in ("silu", "relu2"):
            raise InvalidArgument(f"expert activation {self.activation!r} is not supported (silu, relu2 are)")
        if self.limit < 0 or (self.limit and not self.gated):
            raise InvalidArgument(f"an expert clamp {self.limit} applies to gated (silu) experts, at least 0")
        if self.scoring not in ("softmax", "sigmoid"):
            raise InvalidArgument(f"router scoring {self.scoring!r} is not supported (softmax, sigmoid are)")
        if self.group_score not in ("top2", "max"):
            raise InvalidArgument(f"router group score {self.group_score!r} is not supported (top2, max are)")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise InvalidArgument(f"n_group {self.n_group} must divide {self.num_experts} experts and topk_group "
                                  f"{self.topk_group} be in 1..{self.n_group}")
        if self.n_group > 1 and (self.num_experts // self.n_group < 2
                                 or self.top_k > self.topk_group * self.num_experts // self.n_group):
            raise InvalidArgument(f"top-{self.top_k} over {self.topk_group} of {self.n_group} groups of "
                                  f"{self.num_experts // self.n_group} experts cannot be chosen")


def tensor_parallel(moe: MoeConfig, shard: Shard) -> tuple[MoeConfig, dict]:
    """A rank's mixture (its share of each expert's and the shared experts' width; the router whole, so every rank
    routes a token to the same experts and sums its slice of each) and the experts' splits (parallel/sharding.py),
    each expert's tensors or transformers 5's stacked ones: the first projection (a gated one's gate rows, then its
    up rows, each by rows) by output rows, the down projection by input columns."""
    gate, up, down = moe.expert_names
    splits = {**{f"{name}.{t}": COLUMNS for name in (gate, up) if name for t in ("weight", "bias")},
              f"{down}.weight": ROWS, f"{down}.bias": ROWS, "experts.down_proj": ROWS,
              **({"experts.gate_up_proj": Segments((moe.width, moe.width), dim=1)} if moe.gated
                 else {"experts.up_proj": COLUMNS})}
    local = replace(moe, width=shard.divided(moe.width, "the experts' width"),
                    shared_width=shard.divided(moe.shared_width, "the shared experts' width"))
    return local, splits


def load_moe(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str, moe: MoeConfig,
             ops: LayerMath, shared_bias: bool = False) -> dict:
    """Layer `prefix`'s mixture, uploaded: "router" (MoeRouter), "experts" (Experts) and, with shared experts,
    "shared": their MLP's "up_proj" (gate rows then up rows where gated) and "down_proj" (with "up_proj_bias" and
    "down_proj_bias" where shared_bias). One layer's experts are on the host at a time."""
    stacked_name = "experts.gate_up_proj" if moe.gated else "experts.up_proj"
    stacked_module = f"{prefix}{moe.stacked_module or moe.module}."
    stacked = has(stacked_module + stacked_name)      # transformers 5's stacked experts (and its module name)
    module = stacked_module if stacked else f"{prefix}{moe.module}."
    correction = ops.upload_float32(take(module + "gate.e_score_correction_bias")) if moe.correction_bias else None
    router = moe.router(ops.upload(take(module + "gate.weight")), correction)
    if stacked:
        up, down = take(module + stacked_name), take(module + "experts.down_proj")
    else:
        up = torch.stack([_up(take, f"{module}experts.{e}.", moe) for e in range(moe.num_experts)])
        down = torch.stack([take(f"{module}experts.{e}.{moe.expert_names[2]}.weight") for e in range(moe.num_experts)])
    layer = {"router": router, "experts": ops.upload_experts(up, down, moe.activation, moe.limit)}
    if moe.shared_width:
        at = module + "shared_experts."
        gate, up, down_name = moe.expert_names
        shared = {"up_proj": ops.upload(_up(take, at, moe)), "down_proj": ops.upload(take(f"{at}{down_name}.weight"))}
        if shared_bias:
            bias = take(f"{at}{up}.bias")
            if moe.gated:
                bias = torch.cat([take(f"{at}{gate}.bias"), bias])
            shared.update(up_proj_bias=ops.upload(bias), down_proj_bias=ops.upload(take(f"{at}{down_name}.bias")))
        layer["shared"] = shared
    return layer


def _up(take: Callable[[str], torch.Tensor], prefix: str, moe: MoeConfig) -> torch.Tensor:
    """An expert's first projection: its gate's rows then its up's where gated, else its up's."""
    gate, up = moe.expert_names[:2]
    if not moe.gated:
        return take(f"{prefix}{up}.weight")
    return torch.cat([take(f"{prefix}{gate}.weight"), take(f"{prefix}{up}.weight")])
