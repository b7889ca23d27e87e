"""Launchers for cuda_kernels/hyper.cu: mHC hyper-connections (DeepSeek-V4, Hy4) over a token's hc_mult residual
streams, bf16 [T, hc_mult * hidden]: widen, collapse, expand, the block boundary (expand then the next collapse, in
one kernel) and the head. A mix is post float32 [T, hc_mult] and, with DeepSeek-V4's Sinkhorn comb, comb float32
[T, hc_mult * hc_mult] (row-major [j][k]: stream k takes comb[j][k] of stream j), both contiguous.

collapse, boundary and head run a CTA per token where the tokens fill the GPU; for a few tokens (a decode) each
token's row is split into pieces, a CTA each, so the projection's weights are read by many SMs at once: the pieces'
dot products meet in a Scratch, and the CTA of a token's last piece to finish writes its input and mix."""

from typing import NamedTuple

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.layer_math import HyperConnection, HyperHead, RmsNorm

MODULE = "hyper"
THREADS = 256                  # as hyper_pieces.cuh's HYPER_THREADS
MAX_STREAMS = 8                # as hyper_pieces.cuh's HYPER_MAX_STREAMS
MAX_ROWS = 2 * MAX_STREAMS + MAX_STREAMS ** 2      # as hyper_pieces.cuh's HYPER_MAX_ROWS: fn's rows at the most
# Pieces: a launch's CTAs where tokens are split (about two an SM on an H200), and the fewest 16-byte units of each
# stream a piece holds. Tokens are split only where T <= PIECE_CTAS // 2, so T * slices <= PIECE_CTAS.
PIECE_CTAS = 256
MIN_SPAN = 8
# The staged row beside the kernels' static shared arrays (3.5 KB), under the 227 KB a CTA may opt into.
MAX_SHARED_BYTES = 220 * 1024
NULL = np.uint64(0)


class Scratch(NamedTuple):
    """Where a token's pieces meet: partials float32 [PIECE_CTAS * (MAX_ROWS + 1)] (each piece's dot products) and
    arrivals int32 [PIECE_CTAS // 2] (each token's finished pieces; zero between launches)."""
    partials: DeviceTensor
    arrivals: DeviceTensor


SCRATCH_SHAPES = {"partials": ((PIECE_CTAS * (MAX_ROWS + 1),), "float32"), "arrivals": ((PIECE_CTAS // 2,), "int32")}


def shared_bytes(hc_mult: int, span: int) -> int:
    """The dynamic shared memory of collapse, boundary and head: a piece of span 16-byte units of each stream."""
    return 16 * hc_mult * span


def pieces(num_tokens: int, hidden: int, scratch: Scratch | None) -> tuple[int, int]:
    """(slices, span): each token's row in slices pieces of span 16-byte units of each stream (the last may hold
    fewer); one piece, the whole row, without a scratch or where the tokens alone fill the GPU."""
    groups = hidden // 8
    slices = 1 if scratch is None else max(1, min(PIECE_CTAS // max(num_tokens, 1), ceil_div(groups, MIN_SPAN)))
    span = ceil_div(groups, slices)
    return ceil_div(groups, span), span


def widen(lib, stream, streams: DeviceTensor, x: DeviceTensor, hc_mult: int) -> None:
    """streams [T, hc_mult * hidden] = x [T, hidden] in every stream, bf16."""
    num_tokens, hidden = _rows("hyper_widen", x, "x")
    _check_streams("hyper_widen", streams, num_tokens, hc_mult, hidden)
    if num_tokens == 0:
        return
    groups = hidden // 8
    launch_kernel(stream, lib.get("hyper_widen", MODULE), ceil_div(num_tokens * groups, THREADS), THREADS, streams,
                  np.int64(streams.stride // 8), x, np.int64(x.stride // 8), num_tokens, hc_mult, groups)


def collapse(lib, stream, x: DeviceTensor, post: DeviceTensor, comb: DeviceTensor | None, streams: DeviceTensor,
             hc: HyperConnection, scratch: Scratch | None = None, norm: RmsNorm | None = None) -> None:
    """A block's input x [T, hidden] (bf16) from streams [T, hc_mult * hidden] by hc (fn, base, scale float32 device
    tensors), through norm where given (weight [hidden] bf16), and its mix: post, and comb where hc.sinkhorn_iters
    (else None). scratch: a few tokens' pieces meet there (None: a CTA per token)."""
    name = "hyper_collapse"
    num_tokens, hidden = _check_connection(name, x, streams, post, comb, hc)
    if num_tokens == 0:
        return
    (slices, span), shared = _pieces(name, num_tokens, hc.hc_mult, hidden, scratch)
    launch_kernel(stream, lib.get_with_shared(name, MODULE, shared), (num_tokens, slices), THREADS, x,
                  np.int64(x.stride), post, _pointer(comb), streams, np.int64(streams.stride),
                  *_connection_args(hc, hidden), *_norm_args(name, norm, hidden), *_scratch_args(scratch), span,
                  shmem=shared)


def expand(lib, stream, new_streams: DeviceTensor, out: DeviceTensor, streams: DeviceTensor, post: DeviceTensor,
           comb: DeviceTensor | None) -> None:
    """new_streams [T, hc_mult * hidden] = the streams after a block: stream k = post[k] * out [T, hidden] + (sum
    over j of comb[j][k] * stream j, or stream k where comb is None), fp32 rounded to bf16. new_streams may be
    streams (in place); hc_mult is post's width."""
    name = "hyper_expand"
    num_tokens, hidden = _rows(name, out, "out")
    require(len(post.shape) == 2, f"{name}: post must be [T, hc_mult], not {post.shape}")
    hc_mult = post.shape[1]
    _check_streams(name, streams, num_tokens, hc_mult, hidden)
    _check_streams(name, new_streams, num_tokens, hc_mult, hidden)
    _check_mix(name, post, comb, num_tokens, hc_mult, comb is not None)
    if num_tokens == 0:
        return
    groups = hidden // 8
    launch_kernel(stream, lib.get(name, MODULE), ceil_div(num_tokens * groups, THREADS), THREADS, new_streams,
                  np.int64(new_streams.stride // 8), out, np.int64(out.stride // 8), streams,
                  np.int64(streams.stride // 8), post, _pointer(comb), num_tokens, hc_mult, groups)


def boundary(lib, stream, x: DeviceTensor, streams: DeviceTensor, post: DeviceTensor, comb: DeviceTensor | None,
             out: DeviceTensor, hc: HyperConnection, scratch: Scratch | None = None, norm: RmsNorm | None = None
             ) -> None:
    """expand then hc's collapse, in one kernel and in place: streams become the streams after the block whose
    output is out [T, hidden] and whose mix is (post, comb); x [T, hidden] the next block's input from them (as bf16
    holds them); post and comb the next block's mix. comb is given where hc.sinkhorn_iters, the mix before and
    after alike (one model's connections all have it or none). scratch and norm as collapse's."""
    name = "hyper_boundary"
    num_tokens, hidden = _check_connection(name, x, streams, post, comb, hc)
    require(out.shape == x.shape, f"{name}: out {out.shape} must have x's shape {x.shape}")
    _rows(name, out, "out")
    if num_tokens == 0:
        return
    (slices, span), shared = _pieces(name, num_tokens, hc.hc_mult, hidden, scratch)
    launch_kernel(stream, lib.get_with_shared(name, MODULE, shared), (num_tokens, slices), THREADS, streams,
                  np.int64(streams.stride), x, np.int64(x.stride), out, np.int64(out.stride), post, _pointer(comb),
                  *_connection_args(hc, hidden), *_norm_args(name, norm, hidden), *_scratch_args(scratch), span,
                  shmem=shared)


def head(lib, stream, x: DeviceTensor, streams: DeviceTensor, hc_head: HyperHead, scratch: Scratch | None = None,
         norm: RmsNorm | None = None) -> None:
    """x [T, hidden] = the streams [T, hc_mult * hidden] after the last block, collapsed by hc_head (fn [hc_mult,
    hc_mult * hidden], base [hc_mult], scale [1], float32 device tensors). scratch and norm as collapse's."""
    name = "hyper_head"
    num_tokens, hidden = _rows(name, x, "x")
    _check_streams(name, streams, num_tokens, hc_head.hc_mult, hidden)
    _check_projection(name, hc_head, hc_head.hc_mult, 1, hidden)
    if num_tokens == 0:
        return
    (slices, span), shared = _pieces(name, num_tokens, hc_head.hc_mult, hidden, scratch)
    launch_kernel(stream, lib.get_with_shared(name, MODULE, shared), (num_tokens, slices), THREADS, x,
                  np.int64(x.stride), streams, np.int64(streams.stride), hc_head.fn, hc_head.base, hc_head.scale,
                  hc_head.hc_mult, hidden, float(hc_head.norm_eps), float(hc_head.eps), *_norm_args(name, norm, hidden),
                  *_scratch_args(scratch), span, shmem=shared)


def _pieces(name: str, num_tokens: int, hc_mult: int, hidden: int, scratch: Scratch | None
            ) -> tuple[tuple[int, int], int]:
    """pieces() and their shared memory, the scratch checked."""
    if scratch is not None:
        for field, (shape, dtype) in SCRATCH_SHAPES.items():
            tensor = getattr(scratch, field)
            require(tensor.dtype == dtype and tensor.is_contiguous and tensor.numel >= shape[0],
                    f"{name}: the scratch's {field} must be {shape[0]} contiguous {dtype} at least")
    slices, span = pieces(num_tokens, hidden, scratch)
    return (slices, span), shared_bytes(hc_mult, span)


def _norm_args(name: str, norm: RmsNorm | None, hidden: int) -> tuple:
    """The kernels' norm_weight and out_norm_eps (null: the input as the collapse leaves it)."""
    if norm is None:
        return NULL, 0.0
    weight = norm.weight
    require(weight.dtype == "bfloat16" and weight.shape == (hidden,) and weight.ptr % 16 == 0,
            f"{name}: the norm's weight must be [{hidden}] bfloat16, 16-byte aligned, not {weight.shape} {weight.dtype}")
    return weight, float(norm.eps)


def _scratch_args(scratch: Scratch | None) -> tuple:
    """The kernels' partials and arrivals (null without a scratch: one piece a token never reads them)."""
    return (NULL, NULL) if scratch is None else (scratch.partials, scratch.arrivals)


def _connection_rows(hc: HyperConnection) -> int:
    """fn's rows: pre's and post's logits, then comb's."""
    return 2 * hc.hc_mult + (hc.hc_mult ** 2 if hc.sinkhorn_iters else 0)


def _connection_args(hc: HyperConnection, hidden: int) -> tuple:
    """hyper_collapse's and hyper_boundary's parameters from fn on."""
    return (hc.fn, hc.base, hc.scale, hc.hc_mult, hidden, float(hc.norm_eps), float(hc.eps),
            float(hc.post_magnitude), float(hc.post_eps), int(hc.sinkhorn_iters))


def _check_connection(name: str, x: DeviceTensor, streams: DeviceTensor, post: DeviceTensor,
                      comb: DeviceTensor | None, hc: HyperConnection) -> tuple[int, int]:
    """(T, hidden) of a collapse from streams into x by hc, its mix (post, comb) checked."""
    num_tokens, hidden = _rows(name, x, "x")
    _check_streams(name, streams, num_tokens, hc.hc_mult, hidden)
    _check_mix(name, post, comb, num_tokens, hc.hc_mult, hc.sinkhorn_iters > 0)
    _check_projection(name, hc, _connection_rows(hc), 3 if hc.sinkhorn_iters else 2, hidden)
    return num_tokens, hidden


def _rows(name: str, tensor: DeviceTensor, label: str) -> tuple[int, int]:
    """A [T, hidden] bf16 tensor with 16-byte aligned rows, hidden % 8 == 0 -> (T, hidden)."""
    require(len(tensor.shape) == 2 and tensor.dtype == "bfloat16",
            f"{name}: {label} must be [T, hidden] bfloat16, not {tensor.shape} {tensor.dtype}")
    hidden = tensor.shape[1]
    require(hidden > 0 and hidden % 8 == 0, f"{name}: hidden {hidden} must be a positive multiple of 8")
    require_aligned(tensor, 16, f"{name}: {label}")
    return tensor.shape


def _check_streams(name: str, streams: DeviceTensor, num_tokens: int, hc_mult: int, hidden: int) -> None:
    require(1 <= hc_mult <= MAX_STREAMS, f"{name}: hc_mult {hc_mult} must be 1 to {MAX_STREAMS}")
    require(streams.dtype == "bfloat16" and streams.shape == (num_tokens, hc_mult * hidden),
            f"{name}: streams must be [{num_tokens}, {hc_mult} * {hidden}] bfloat16, not {streams.shape} "
            f"{streams.dtype}")
    require_aligned(streams, 16, f"{name}: streams")
    require(shared_bytes(hc_mult, hidden // 8) <= MAX_SHARED_BYTES,
            f"{name}: a token's {hc_mult} streams of {hidden} are more than shared memory holds")


def _check_mix(name: str, post: DeviceTensor, comb: DeviceTensor | None, num_tokens: int, hc_mult: int,
               with_comb: bool) -> None:
    require(post.dtype == "float32" and post.shape == (num_tokens, hc_mult) and post.is_contiguous,
            f"{name}: post must be [{num_tokens}, {hc_mult}] float32, contiguous, not {post.shape} {post.dtype}")
    require((comb is not None) == with_comb, f"{name}: comb must be given where the connection has one, only there")
    if comb is not None:
        require(comb.dtype == "float32" and comb.shape == (num_tokens, hc_mult * hc_mult) and comb.is_contiguous,
                f"{name}: comb must be [{num_tokens}, {hc_mult} * {hc_mult}] float32, contiguous, not {comb.shape} "
                f"{comb.dtype}")


def _check_projection(name: str, hc: HyperConnection | HyperHead, rows: int, scales: int, hidden: int) -> None:
    """fn [rows, hc_mult * hidden] (16-byte aligned: read in float4s), base [rows], scale [scales], float32."""
    width = hc.hc_mult * hidden
    require(hc.fn.dtype == "float32" and hc.fn.shape == (rows, width) and hc.fn.is_contiguous,
            f"{name}: fn must be [{rows}, {width}] float32, contiguous, not {hc.fn.shape} {hc.fn.dtype}")
    require(hc.fn.ptr % 16 == 0, f"{name}: fn must be 16-byte aligned")
    require(hc.base.dtype == "float32" and hc.base.shape == (rows,),
            f"{name}: base must be [{rows}] float32, not {hc.base.shape} {hc.base.dtype}")
    require(hc.scale.dtype == "float32" and hc.scale.shape == (scales,),
            f"{name}: scale must be [{scales}] float32, not {hc.scale.shape} {hc.scale.dtype}")


def _pointer(tensor: DeviceTensor | None):
    return NULL if tensor is None else tensor
