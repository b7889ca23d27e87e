"""Launchers for cuda_kernels/ssm.cu: Mamba2's conv and selective scan over each segment's recurrent state, and its
gated RMSNorm."""

from dataclasses import dataclass

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "ssm"
CONV_BLOCK = 128
CONV_TOKENS = 16            # SSM_CONV_TOKENS
MAX_CONV_KERNEL = 8         # SSM_MAX_CONV_KERNEL
SCAN_LANES = 8              # SSM_SCAN_LANES
MAX_STATE_SIZE = 8 * 32     # SSM_SCAN_LANES * SSM_MAX_STATE_PER_LANE
NORM_BLOCK = 256


@dataclass(frozen=True)
class Segments:
    """A forward's segments as the SSM kernels read them: int32 [S] each, on the device; max_len the longest."""
    starts: DeviceTensor
    lens: DeviceTensor
    sources: DeviceTensor
    destinations: DeviceTensor
    count: int
    max_len: int


def conv(lib, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
         conv_state: DeviceTensor, segments: Segments) -> None:
    """out [T, C] = silu(causal depthwise conv of x [T, C] (weight [C, K]) continuing from each segment's conv
    state [slots, C, K - 1]), then the state after each segment into its destination slot. bf16 activations and
    weights, float32 state."""
    require(len(x.shape) == 2 and out.shape == x.shape, f"ssm conv: out {out.shape} and x {x.shape} must be [T, C]")
    channels, width = weight.shape
    require(x.shape[1] == channels, f"ssm conv: x has {x.shape[1]} channels, weight {channels}")
    require(2 <= width <= MAX_CONV_KERNEL, f"ssm conv: kernel width {width} must be in [2, {MAX_CONV_KERNEL}]")
    require(conv_state.dtype == "float32" and conv_state.shape[1:] == (channels, width - 1),
            f"ssm conv: conv_state {conv_state.shape} {conv_state.dtype} must be float32 [slots, {channels}, "
            f"{width - 1}]")
    require(all(t.dtype == "bfloat16" for t in (out, x, weight)) and (bias is None or bias.dtype == "bfloat16"),
            "ssm conv: out, x, weight and bias must be bfloat16")
    if segments.count == 0 or segments.max_len == 0:
        return
    grid = (ceil_div(channels, CONV_BLOCK), segments.count, ceil_div(segments.max_len, CONV_TOKENS))
    launch_kernel(stream, lib.get("ssm_conv", MODULE), grid, CONV_BLOCK, out, np.int64(out.stride), x,
                  np.int64(x.stride), weight, np.uint64(bias.ptr if bias is not None else 0), conv_state,
                  segments.starts, segments.lens, segments.sources, channels, width)
    launch_kernel(stream, lib.get("ssm_conv_state", MODULE), (ceil_div(channels, CONV_BLOCK), segments.count),
                  CONV_BLOCK, conv_state, x, np.int64(x.stride), segments.starts, segments.lens, segments.sources,
                  segments.destinations, channels, width)


def scan(lib, stream, y: DeviceTensor, xbc: DeviceTensor, dt: DeviceTensor, A: DeviceTensor, D: DeviceTensor,
         dt_bias: DeviceTensor, ssm_state: DeviceTensor, segments: Segments, n_groups: int, dt_min: float,
         dt_max: float) -> None:
    """y [T, heads * head_dim] = the selective scan of each segment from its state ([slots, heads, head_dim,
    state_size] float32; the state after it into the destination slot) + D * x; xbc [T, inner + 2 * n_groups *
    state_size] the conv's output, dt [T, heads] before its bias. A, D, dt_bias float32 [heads]."""
    _, num_heads, head_dim, state_size = ssm_state.shape
    inner = num_heads * head_dim
    require(ssm_state.dtype == "float32", "ssm scan: the state must be float32")
    require(head_dim % 4 == 0 and head_dim * SCAN_LANES <= 1024,
            f"ssm scan: head_dim {head_dim} must be a multiple of 4 and at most {1024 // SCAN_LANES}")
    require(state_size % SCAN_LANES == 0 and state_size <= MAX_STATE_SIZE,
            f"ssm scan: state_size {state_size} must be a multiple of {SCAN_LANES}, at most {MAX_STATE_SIZE}")
    require(num_heads % n_groups == 0, f"ssm scan: {num_heads} heads in {n_groups} groups")
    require(xbc.shape[1] == inner + 2 * n_groups * state_size and y.shape == (xbc.shape[0], inner)
            and dt.shape == (xbc.shape[0], num_heads),
            f"ssm scan: xbc {xbc.shape}, y {y.shape}, dt {dt.shape} do not fit {num_heads} heads of {head_dim}")
    require(all(t.dtype == "bfloat16" for t in (y, xbc, dt)), "ssm scan: y, xbc and dt must be bfloat16")
    require(all(t.dtype == "float32" and t.shape == (num_heads,) for t in (A, D, dt_bias)),
            "ssm scan: A, D and dt_bias must be float32 [heads]")
    if segments.count == 0:
        return
    launch_kernel(stream, lib.get("ssm_scan", MODULE), (num_heads, segments.count), head_dim * SCAN_LANES, y,
                  np.int64(y.stride), xbc, np.int64(xbc.stride), dt, np.int64(dt.stride), A, D, dt_bias, ssm_state,
                  segments.starts, segments.lens, segments.sources, segments.destinations, num_heads, head_dim,
                  n_groups, state_size, float(dt_min), float(min(dt_max, np.finfo(np.float32).max)))


def gated_norm(lib, stream, out: DeviceTensor, x: DeviceTensor, gate: DeviceTensor, weight: DeviceTensor,
               eps: float, group_size: int, norm_before_gate: bool) -> None:
    """out [T, I] = the gated RMSNorm of x [T, I] with gate [T, I] over each group_size slice (ssm.cu
    ssm_gated_norm), bf16."""
    require(len(x.shape) == 2 and out.shape == x.shape == gate.shape,
            f"ssm gated norm: out {out.shape}, x {x.shape} and gate {gate.shape} must be one [T, I]")
    num_tokens, width = x.shape
    require(width % group_size == 0 and weight.shape == (width,),
            f"ssm gated norm: width {width} in groups of {group_size}, weight {weight.shape}")
    require(all(t.dtype == "bfloat16" for t in (out, x, gate, weight)), "ssm gated norm: bf16 tensors only")
    if num_tokens == 0:
        return
    launch_kernel(stream, lib.get("ssm_gated_norm", MODULE), (width // group_size, num_tokens), NORM_BLOCK, out,
                  np.int64(out.stride), x, np.int64(x.stride), gate, np.int64(gate.stride), weight, group_size,
                  float(eps), int(norm_before_gate))


COPY_BLOCK = 256
COPY_WORDS = 4              # SSM_COPY_WORDS


@dataclass(frozen=True)
class StateTable:
    """Every recurrent layer's state tensors as ssm_copy_slots reads them: bases (uint64 [n] addresses) and
    slot_words (int64 [n], 16-byte words a slot), on the device; largest_slot_words the most of any tensor."""
    bases: DeviceTensor
    slot_words: DeviceTensor
    count: int
    largest_slot_words: int


def copy_slots(lib, stream, table: StateTable, copies: DeviceTensor, num_copies: int) -> None:
    """Whole slots of every state tensor, copies[j][0] -> copies[j][1] (int32 [num_copies, 2] on the device); no
    copy's destination may be another's source."""
    if num_copies == 0 or table.count == 0:
        return
    grid = (ceil_div(table.largest_slot_words, COPY_BLOCK * COPY_WORDS), table.count, num_copies)
    launch_kernel(stream, lib.get("ssm_copy_slots", MODULE), grid, COPY_BLOCK, table.bases, table.slot_words, copies)
