"""Hyper-connection streams on the CUDA backend (CudaLayerMath's hyper_* ops): the residual's streams and a block's
mix in the stream's own buffers (they live through every layer of a forward, past the activation ring), the
kernels of kernels/hyper.py on them, the streams and the mix updated in place; a decode's few tokens split into pieces
that meet in the stream's scratch."""

from typing import NamedTuple

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.stream_context import StreamContext
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.layer_math import HyperConnection, HyperHead, RmsNorm


class Mix(NamedTuple):
    """A block's post [T, hc_mult] and comb [T, hc_mult^2] (None: a connection without one), float32."""
    post: DeviceTensor
    comb: DeviceTensor | None


def widen(lib, ctx: StreamContext, x: DeviceTensor, hc_mult: int) -> DeviceTensor:
    streams = ctx.hyper["streams"].rows(0, x.shape[0])
    kernels.hyper.widen(lib, ctx.stream, streams, x, hc_mult)
    return streams


def collapse(lib, ctx: StreamContext, streams: DeviceTensor, hc: HyperConnection, norm: RmsNorm | None = None
             ) -> tuple[DeviceTensor, Mix]:
    tokens = streams.shape[0]
    x, mix = ctx.new(tokens, streams.shape[1] // hc.hc_mult), _mix(ctx, tokens, hc)
    kernels.hyper.collapse(lib, ctx.stream, x, mix.post, mix.comb, streams, hc, _scratch(ctx), norm)
    return x, mix


def expand(lib, ctx: StreamContext, out: DeviceTensor, streams: DeviceTensor, mix: Mix) -> DeviceTensor:
    kernels.hyper.expand(lib, ctx.stream, streams, out, streams, mix.post, mix.comb)
    return streams


def boundary(lib, ctx: StreamContext, out: DeviceTensor, streams: DeviceTensor, mix: Mix, hc: HyperConnection,
             norm: RmsNorm | None = None) -> tuple[DeviceTensor, DeviceTensor, Mix]:
    """One kernel: the streams after the block (in place), the next block's input (through norm), and its mix (in
    place)."""
    x = ctx.new(*out.shape)
    kernels.hyper.boundary(lib, ctx.stream, x, streams, mix.post, mix.comb, out, hc, _scratch(ctx), norm)
    return streams, x, mix


def head(lib, ctx: StreamContext, streams: DeviceTensor, hc_head: HyperHead, norm: RmsNorm | None = None
         ) -> DeviceTensor:
    x = ctx.new(streams.shape[0], streams.shape[1] // hc_head.hc_mult)
    kernels.hyper.head(lib, ctx.stream, x, streams, hc_head, _scratch(ctx), norm)
    return x


def _mix(ctx: StreamContext, tokens: int, hc: HyperConnection) -> Mix:
    comb = ctx.hyper["comb"].rows(0, tokens) if hc.sinkhorn_iters else None
    return Mix(ctx.hyper["post"].rows(0, tokens), comb)


def _scratch(ctx: StreamContext) -> kernels.hyper.Scratch:
    return kernels.hyper.Scratch(ctx.hyper["partials"], ctx.hyper["arrivals"])
