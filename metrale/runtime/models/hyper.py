"""Manifold-constrained hyper-connections (mHC) as decoders use them: the residual widened into hc_mult streams,
each block's input collapsed from them and its output written back (LayerMath's HyperConnection), the streams
collapsed once more before the final norm (HyperHead). Config and tensors, as transformers names them."""

from dataclasses import dataclass

from metrale.runtime.backend.layer_math import HyperConnection, HyperHead, LayerMath
from metrale.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class HyperConfig:
    hc_mult: int
    norm_eps: float                     # the streams' weightless RMSNorm
    eps: float                          # hc_eps
    post_magnitude: float = 2.0
    post_eps: float = 0.0
    sinkhorn_iters: int = 0             # 0: no comb matrix (Hy4); DeepSeek-V4's hc_sinkhorn_iters

    def __post_init__(self):
        if self.hc_mult < 1:
            raise InvalidArgument(f"hc_mult {self.hc_mult} must be at least 1")

    @property
    def projection_rows(self) -> int:
        """fn's rows: pre and post logits, and comb's where it has one."""
        return (2 + (self.hc_mult if self.sinkhorn_iters else 0)) * self.hc_mult


def float32_numel(config: HyperConfig, hidden: int, layers: int) -> int:
    """The elements uploaded in float32: two connections a layer (fn, base, scale) and the head."""
    rows, width = config.projection_rows, config.hc_mult * hidden
    return 2 * layers * (rows * width + rows + 3) + config.hc_mult * (width + 1) + 1


def load_connection(take, prefix: str, config: HyperConfig, hidden: int, ops: LayerMath) -> HyperConnection:
    """The connection of module `prefix` (attn_hc. or ffn_hc.: fn, base, scale), uploaded in float32."""
    fn = take(prefix + "fn")
    if tuple(fn.shape) != (config.projection_rows, config.hc_mult * hidden):
        raise InvalidArgument(f"{prefix}fn is {tuple(fn.shape)}, not ({config.projection_rows}, "
                              f"{config.hc_mult * hidden})")
    return HyperConnection(ops.upload_float32(fn), ops.upload_float32(take(prefix + "base")),
                           ops.upload_float32(take(prefix + "scale")), config.hc_mult, config.norm_eps, config.eps,
                           config.post_magnitude, config.post_eps, config.sinkhorn_iters)


def load_head(take, prefix: str, config: HyperConfig, ops: LayerMath) -> HyperHead:
    """The final collapse (hc_fn, hc_base, hc_scale of module `prefix`), uploaded in float32."""
    return HyperHead(ops.upload_float32(take(prefix + "hc_fn")), ops.upload_float32(take(prefix + "hc_base")),
                     ops.upload_float32(take(prefix + "hc_scale")), config.hc_mult, config.norm_eps, config.eps)
