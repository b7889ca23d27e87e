"""The Mamba2 mixer, in layer math, as every SSM family here uses it (Mamba2, Nemotron-H, Falcon-H1, Granite 4.0-H):
in_proj to the gate z, the conv's channels (x, B, C) and dt; the causal conv; the selective scan over the sequence's
state; the gated RMSNorm; out_proj."""

import math
from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LayerMath, SsmScan
from metrale.runtime.cache.specs import RecurrentState
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS, Segments

# The longest sequence of a model whose config sets no position limit (a pure SSM has none): the default
# max_model_len there; --max-model-len may set more.
UNLIMITED_POSITIONS_MAX_LEN = 131072
NORMS = ("after_gate", "before_gate", "none")


@dataclass(frozen=True)
class MixerShape:
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float
    in_bias: bool = False
    out_bias: bool = False
    use_conv_bias: bool = True
    dt_min: float = 0.0
    dt_max: float = math.inf
    # How the scan's output meets the gate z before out_proj: "after_gate" RMSNorm(y * silu(z)) (Mamba2's),
    # "before_gate" RMSNorm(y) * silu(z), "none" y * silu(z); the norm over each of n_groups groups.
    norm: str = "after_gate"

    def __post_init__(self):
        if self.num_heads % self.n_groups:
            raise InvalidArgument(f"mamba num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")
        if self.norm not in NORMS:
            raise InvalidArgument(f"mixer norm {self.norm!r} is not one of {NORMS}")
        if self.conv_kernel < 2 or self.chunk_size < 1:
            raise InvalidArgument(f"conv_kernel={self.conv_kernel} and chunk_size={self.chunk_size} must be >= 2 "
                                  f"and >= 1")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_size(self) -> int:
        return self.inner_size + 2 * self.n_groups * self.state_size

    @property
    def activation_width(self) -> int:
        """Activation elements (bf16-sized) a token's pass through the mixer takes at the most: in_proj's output, the
        conv's, the scan's, the norm's, out_proj's, one hidden-wide sum (Falcon-H1's two mixers), and its share of a
        chunked scan's workspace (two float32 states and decays a chunk: chunk_slots <= 2 tokens / chunk_size + 1)."""
        workspace = 2 * 2 * (self.inner_size * self.state_size + self.num_heads)
        return (self.inner_size + self.conv_size + self.num_heads) + self.conv_size + 2 * self.inner_size \
            + 2 * self.hidden_size + -(-workspace // self.chunk_size)

    def cache_spec(self) -> RecurrentState:
        """The conv's last conv_kernel - 1 inputs, and the scan's state."""
        return RecurrentState(((self.conv_size, self.conv_kernel - 1),
                               (self.num_heads, self.head_dim, self.state_size)))


def tensor_parallel(shape: MixerShape, shard: Shard, module: str = "mixer.") -> tuple[MixerShape, dict]:
    """A rank's mixer (its share of the heads, and of the groups of B and C whose heads it holds) and the splits of
    its tensors under `module`: in_proj's gate, x, B, C and dt rows and the conv's x, B and C channels each by heads
    or groups, the scan's per-head A, D and dt bias and the gated norm's weight (a group's norm is its rank's)
    likewise, out_proj by input columns. Fewer groups than ranks (a divisor of their number) and no norm: each
    rank's heads read one group, which it holds (the ranks of one group hold it alike); with the norm, a group's
    statistics would span ranks, which is refused."""
    groups, size = shape.n_groups, shard.size
    pieces = None
    if groups % size:
        if size % groups or shape.norm != "none":
            raise InvalidArgument(f"mamba n_groups ({groups}) is not a multiple of --tensor-parallel {size}"
                                  + ("" if size % groups else " (fewer groups than ranks split only without the "
                                                              "mixer's gated norm)"))
        pieces = (size, size, groups, groups, size)
    local = replace(shape, num_heads=shard.divided(shape.num_heads, "mamba num_heads"),
                    n_groups=max(groups // size, 1))
    inner, width = shape.inner_size, groups * shape.state_size
    projected = Segments((inner, inner, width, width, shape.num_heads), pieces=pieces)
    channels = Segments((inner, width, width), pieces=pieces and pieces[1:4])
    splits = {"in_proj.weight": projected, "in_proj.bias": projected, "conv1d.weight": channels,
              "conv1d.bias": channels, "A_log": COLUMNS, "D": COLUMNS, "dt_bias": COLUMNS, "norm.weight": COLUMNS,
              "out_proj.weight": ROWS, "out_proj.bias": ROWS}
    return local, {module + name: kind for name, kind in splits.items()}


def hf_float(value) -> float:
    """A float of a config.json as transformers writes it ({"__float__": "Infinity"} for inf)."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def load_mixer(take, prefix: str, shape: MixerShape, ops: LayerMath, in_scale: torch.Tensor | None = None,
               input_scale: float = 1.0, out_scale: float = 1.0) -> dict:
    """The mixer's tensors under prefix (e.g. "model.layers.0.mixer."), uploaded; take(name) reads one. Falcon-H1's
    multipliers, folded into the weights and biases: in_scale [in_proj rows] of in_proj's output, input_scale of
    its input, out_scale of out_proj's output."""
    conv_weight = take(prefix + "conv1d.weight")          # [conv_size, 1, K]
    in_scale = torch.ones(1) if in_scale is None else in_scale.float()
    w = {"in_proj": ops.upload(take(prefix + "in_proj.weight").float() * (in_scale * input_scale)[:, None]),
         "conv": ops.upload(conv_weight.reshape(conv_weight.shape[0], conv_weight.shape[-1])),
         "out_proj": ops.upload(take(prefix + "out_proj.weight").float() * out_scale),
         "scan": SsmScan(A=ops.upload_float32(-torch.exp(take(prefix + "A_log").float())),
                         D=ops.upload_float32(take(prefix + "D")),
                         dt_bias=ops.upload_float32(take(prefix + "dt_bias")),
                         num_heads=shape.num_heads, head_dim=shape.head_dim, n_groups=shape.n_groups,
                         state_size=shape.state_size, chunk_size=shape.chunk_size, dt_min=shape.dt_min,
                         dt_max=shape.dt_max)}
    if shape.norm != "none":
        w["gated_norm"] = ops.upload(take(prefix + "norm.weight"))
    if shape.use_conv_bias:
        w["conv_bias"] = ops.upload(take(prefix + "conv1d.bias"))
    if shape.in_bias:
        w["in_proj_bias"] = ops.upload(take(prefix + "in_proj.bias").float() * in_scale)
    if shape.out_bias:
        w["out_proj_bias"] = ops.upload(take(prefix + "out_proj.bias").float() * out_scale)
    return w


def mixer(ops: LayerMath, h, w: dict, shape: MixerShape, meta, state) -> object:
    """h [T, hidden] -> [T, hidden]; state: the layer's (conv state, scan state) slot tensors. Under tensor parallel
    (tensor_parallel) shape is a rank's share of the heads and groups, and out_proj's partial sums are summed."""
    conv_state, ssm_state = state
    inner, conv_size = shape.inner_size, shape.conv_size
    projected = ops.linear(h, w["in_proj"], w.get("in_proj_bias"))        # [T, inner + conv_size + heads]
    gate, xbc, dt = (projected[:, :inner], projected[:, inner:inner + conv_size],
                     projected[:, inner + conv_size:])
    xbc = ops.ssm_conv(xbc, w["conv"], w.get("conv_bias"), meta, conv_state)
    y = ops.ssm_scan(xbc, dt, w["scan"], meta, ssm_state)                   # [T, inner]
    if shape.norm == "none":
        y = ops.mul_silu(y, gate)
    else:
        y = ops.gated_rms_norm(y, gate, w["gated_norm"], shape.norm_eps, inner // shape.n_groups,
                               norm_before_gate=shape.norm == "before_gate")
    return ops.all_reduce(ops.linear(y, w["out_proj"], w.get("out_proj_bias")))     # a rank's heads' partial sum
