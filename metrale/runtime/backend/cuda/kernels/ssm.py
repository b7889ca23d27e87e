"""Launchers for cuda_kernels/ssm.cu: Mamba2's conv and selective scan over each segment's recurrent state, and its
gated RMSNorm."""

from dataclasses import dataclass

import numpy as np

from metrale.runtime.backend.cuda.launch import MAX_GRID_YZ, ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "ssm"
CONV_BLOCK = 128
CONV_TOKENS = 16            # SSM_CONV_TOKENS
MAX_CONV_KERNEL = 8         # SSM_MAX_CONV_KERNEL
SCAN_LANES = 8              # SSM_SCAN_LANES
NORM_BLOCK = 256


@dataclass(frozen=True)
class Segments:
    """A forward's segments as the SSM kernels read them: int32 [S] each, on the device; max_len at least the longest
    (the conv's grid). The last long_count are long (chunked_scan's, longer than the model's scan chunk), in row
    order."""
    starts: DeviceTensor
    lens: DeviceTensor
    sources: DeviceTensor
    destinations: DeviceTensor
    count: int
    max_len: int
    long_count: int = 0

    def short(self) -> "Segments":
        """The segments before the long ones."""
        return self._part(0, self.count - self.long_count) if self.long_count else self

    def long(self) -> "Segments":
        return self._part(self.count - self.long_count, self.long_count)

    def _part(self, first: int, count: int) -> "Segments":
        views = (DeviceTensor(t.ptr + 4 * first, (count,), "int32")
                 for t in (self.starts, self.lens, self.sources, self.destinations))
        return Segments(*views, count=count, max_len=self.max_len if count else 0)


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


STATE_SIZES = (16, 32, 64, 128, 256)      # the scan kernels: state_size / SSM_SCAN_LANES registers a thread
CARRY_BLOCK = 256


def scan(lib, stream, y: DeviceTensor, xbc: DeviceTensor, dt: DeviceTensor, A: DeviceTensor, D: DeviceTensor,
         dt_bias: DeviceTensor, ssm_state: DeviceTensor, segments: Segments, n_groups: int, dt_min: float,
         dt_max: float) -> None:
    """y [T, heads * head_dim] = the selective scan of each segment from its state ([slots, heads, head_dim,
    state_size] float32; the state after it into the destination slot) + D * x, a token at a time; xbc [T, inner +
    2 * n_groups * state_size] the conv's output, dt [T, heads] before its bias. A, D, dt_bias float32 [heads]. One
    block per segment and head: for decode steps and short segments (chunked_scan for long ones)."""
    args = _scan_args(y, xbc, dt, A, D, dt_bias, ssm_state, n_groups, dt_min, dt_max)
    if segments.count == 0:
        return
    _, num_heads, head_dim, _ = ssm_state.shape
    launch_kernel(stream, lib.get("ssm_scan", MODULE), (num_heads, segments.count), head_dim * SCAN_LANES, *args,
                  ssm_state, segments.starts, segments.lens, segments.sources, segments.destinations)


def chunk_slots(num_tokens: int, segments: Segments, chunk_size: int) -> int:
    """Workspace slots chunked_scan needs for segments within num_tokens rows: a segment's chunk c takes slot
    start // chunk_size + (its index) + c."""
    return ceil_div(num_tokens, chunk_size) + segments.count


def chunked_scan(lib, stream, y: DeviceTensor, xbc: DeviceTensor, dt: DeviceTensor, A: DeviceTensor,
                 D: DeviceTensor, dt_bias: DeviceTensor, ssm_state: DeviceTensor, segments: Segments, n_groups: int,
                 dt_min: float, dt_max: float, chunk_size: int, chunk_states: DeviceTensor,
                 chunk_decays: DeviceTensor) -> None:
    """scan() for long segments, every chunk of chunk_size tokens at once (ssm.cu ssm_chunk_scan): each chunk's
    end state from zero, the states carried across each segment's chunks, then each chunk's y from its entering
    state. chunk_states float32 [chunk_slots, heads * head_dim * state_size], chunk_decays float32 [chunk_slots,
    heads]: workspace."""
    args = _scan_args(y, xbc, dt, A, D, dt_bias, ssm_state, n_groups, dt_min, dt_max)
    _, num_heads, head_dim, state_size = ssm_state.shape
    require(chunk_size >= 1, f"ssm chunked scan: chunk_size {chunk_size}")
    slots = chunk_slots(xbc.shape[0], segments, chunk_size)
    require(chunk_states.dtype == chunk_decays.dtype == "float32"
            and chunk_states.numel >= slots * num_heads * head_dim * state_size
            and chunk_decays.numel >= slots * num_heads,
            f"ssm chunked scan: the workspace holds fewer than {slots} chunk slots")
    if segments.count == 0 or segments.max_len == 0:
        return
    grid = (num_heads, segments.count, ceil_div(segments.max_len, chunk_size))
    kernel = lib.get("ssm_chunk_scan", MODULE)
    tail = (chunk_states, chunk_decays, segments.starts, segments.lens, chunk_size)
    launch_kernel(stream, kernel, grid, head_dim * SCAN_LANES, *args, *tail, 0)
    launch_kernel(stream, lib.get("ssm_chunk_carry", MODULE),
                  (ceil_div(head_dim * state_size, CARRY_BLOCK), num_heads, segments.count), CARRY_BLOCK, ssm_state,
                  chunk_states, chunk_decays, segments.starts, segments.lens, segments.sources, segments.destinations,
                  num_heads, head_dim, state_size, chunk_size)
    launch_kernel(stream, kernel, grid, head_dim * SCAN_LANES, *args, *tail, 1)


def _scan_args(y, xbc, dt, A, D, dt_bias, ssm_state, n_groups, dt_min, dt_max) -> tuple:
    """The checked arguments that ssm.cu's scan kernels take first (SsmScanArgs' fields)."""
    _, num_heads, head_dim, state_size = ssm_state.shape
    inner = num_heads * head_dim
    require(ssm_state.dtype == "float32", "ssm scan: the state must be float32")
    require(head_dim % 4 == 0 and head_dim * SCAN_LANES <= 1024,
            f"ssm scan: head_dim {head_dim} must be a multiple of 4 and at most {1024 // SCAN_LANES}")
    require(state_size in STATE_SIZES, f"ssm scan: state_size {state_size} must be one of {STATE_SIZES}")
    require(num_heads % n_groups == 0, f"ssm scan: {num_heads} heads in {n_groups} groups")
    require(xbc.shape[1] == inner + 2 * n_groups * state_size and y.shape == (xbc.shape[0], inner)
            and dt.shape == (xbc.shape[0], num_heads),
            f"ssm scan: xbc {xbc.shape}, y {y.shape}, dt {dt.shape} do not fit {num_heads} heads of {head_dim}")
    require(all(t.dtype == "bfloat16" for t in (y, xbc, dt)), "ssm scan: y, xbc and dt must be bfloat16")
    require(all(t.dtype == "float32" and t.shape == (num_heads,) for t in (A, D, dt_bias)),
            "ssm scan: A, D and dt_bias must be float32 [heads]")
    return (y, np.int64(y.stride), xbc, np.int64(xbc.stride), dt, np.int64(dt.stride), A, D, dt_bias, num_heads,
            head_dim, n_groups, state_size, float(dt_min), float(min(dt_max, np.finfo(np.float32).max)))


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
    require(num_tokens <= MAX_GRID_YZ, f"ssm gated norm: {num_tokens} rows, over the grid's {MAX_GRID_YZ}")
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
