"""Launchers for cuda_kernels/moe_route.cu and moe.cu: a mixture-of-experts layer's routing with its entries grouped
by expert, the experts' grouped GEMMs and the weighted combine. Every grid follows the batch's row count alone
(graph-safe)."""

from dataclasses import dataclass

import numpy as np
import torch

from metrale.runtime.backend.cuda.fp8_matrix import BLOCK, Fp8Matrix
from metrale.runtime.backend.cuda.launch import MAX_GRID_YZ, ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.loading.fp8 import Fp8Experts

MODULE, ROUTE_MODULE = "moe", "moe_route"
MAX_EXPERTS = 512           # moe_route.cu's MOE_MAX_EXPERTS
MAX_TOP_K = 16              # MOE_MAX_TOP_K
MAX_GROUPS = 32             # a lane per group
ROUTE_THREADS = 256         # moe_route's: a warp a token
GEMM_THREADS, GEMM_BN = 128, 128               # moe_grouped_gemm_m64/m128's GEMM_THREADS and BN
SKINNY_THREADS, SKINNY_ROWS = 256, 16           # moe_skinny_gemm_m8: skinny_gemm.cuh's
COMBINE_THREADS = 128
# Rows of a grouped GEMM tile -> its kernel: the skinny GEMM's 8 while the entries average at most SKINNY_AVERAGE an
# expert (decode: at Qwen3-30B-A3B's layer it reads the experts at 0.94 of copy bandwidth at 4 rows an expert, where
# the 64-row tile reaches 0.85; at 8 rows the tile is ahead, 0.85 against 0.73), the tiled GEMM's 64 up to 64 an
# expert, else 128 (prefill).
TILE_ROWS = {8: "moe_skinny_gemm_m8", 64: "moe_grouped_gemm_m64", 128: "moe_grouped_gemm_m128"}
SKINNY_AVERAGE = 6
NULL = np.uint64(0)


def tile_rows(entries: int, num_experts: int) -> int:
    """The grouped GEMM's rows a tile for `entries` routed rows over num_experts experts."""
    if entries <= SKINNY_AVERAGE * num_experts:
        return 8
    return 64 if entries <= 64 * num_experts else 128


def logits_width(num_experts: int) -> int:
    """The router logits' row stride (float32): rows of 16 bytes, as cuBLASLt writes them (6 or 62 experts pad)."""
    return ceil_div(num_experts, 4) * 4


def max_tiles(entries: int, num_experts: int, rows: int) -> int:
    """The most tiles `entries` rows make when each expert's rows are cut into tiles of `rows`: every expert
    that has rows adds at most one partial tile."""
    return entries // rows + min(num_experts, entries)


@dataclass(frozen=True)
class Routed:
    """A batch's routed entries on the device: ids and weights [T, top_k], and their grouping by expert (both
    moe_route's): offsets [E + 1], sorted_entries and positions [T * top_k], tiles [max_tiles, 2] and tile_count [1]."""
    ids: DeviceTensor
    weights: DeviceTensor
    offsets: DeviceTensor
    sorted_entries: DeviceTensor
    positions: DeviceTensor
    tiles: DeviceTensor
    tile_count: DeviceTensor
    tile_rows: int

    @property
    def entries(self) -> int:
        return self.sorted_entries.shape[0]


def route(lib, stream, routed: Routed, logits: DeviceTensor, top_k: int, softmax: bool, normalize: bool,
          correction_bias: DeviceTensor | None, n_group: int, topk_group: int, scaling: float,
          done: DeviceTensor, group_score: str = "top2", float32_logits: bool = False) -> None:
    """routed's ids [T, top_k] int32 and weights [T, top_k] float32, each token's chosen experts from its router
    logits [T, E] float32 (rows may be strided: a GEMM's output row is padded to 16 bytes) by MoeRouter's rule
    (layer_math.py), softmax routers' logits rounded to bf16 first unless float32_logits; and, in the same launch,
    routed's grouping of those entries by expert. done: one int32 that is 0 (the launch leaves it 0)."""
    tokens, experts = logits.shape
    entries = tokens * top_k
    require(logits.dtype == "float32" and len(logits.shape) == 2, "moe route: logits must be [T, E] float32")
    require(0 < experts <= MAX_EXPERTS, f"moe route: {experts} experts (at most {MAX_EXPERTS})")
    require(0 < top_k <= min(MAX_TOP_K, experts), f"moe route: top_k {top_k} must be in 1..{min(MAX_TOP_K, experts)}")
    require(routed.ids.shape == (tokens, top_k) and routed.ids.dtype == "int32" and routed.ids.is_contiguous,
            f"moe route: ids must be [{tokens}, {top_k}] int32")
    require(routed.weights.shape == (tokens, top_k) and routed.weights.dtype == "float32"
            and routed.weights.is_contiguous, f"moe route: weights must be [{tokens}, {top_k}] float32")
    require(n_group == 1 or (n_group <= MAX_GROUPS and experts % n_group == 0 and experts // n_group >= 2
                             and 0 < topk_group <= n_group and top_k <= topk_group * (experts // n_group)),
            f"moe route: {n_group} groups (topk_group {topk_group}) of {experts} experts cannot give top-{top_k}")
    require(correction_bias is None or (correction_bias.shape == (experts,) and correction_bias.dtype == "float32"),
            "moe route: correction_bias must be float32 [experts]")
    require(routed.entries == entries and routed.positions.shape == (entries,),
            "moe route: sorted_entries and positions must hold T * top_k entries each")
    require(routed.offsets.shape == (experts + 1,) and routed.tile_count.shape == (1,),
            f"moe route: offsets must be [{experts + 1}], tile_count [1]")
    tiles = routed.tiles.shape[0]
    require(tiles >= max_tiles(entries, experts, routed.tile_rows) and routed.tiles.shape == (tiles, 2),
            f"moe route: tiles must be [>= {max_tiles(entries, experts, routed.tile_rows)}, 2]")
    require(done.shape == (1,) and done.dtype == "int32", "moe route: done must be one int32")
    if tokens == 0:
        return
    launch_kernel(stream, lib.get("moe_route", ROUTE_MODULE), ceil_div(tokens, ROUTE_THREADS // 32), ROUTE_THREADS,
                  logits, logits.stride, tokens, experts, top_k, 0 if softmax else 1,
                  int(softmax and not float32_logits), int(normalize), correction_bias if correction_bias is not None else NULL, n_group, topk_group,
                  int(group_score == "top2"), np.float32(scaling),
                  routed.ids, routed.weights, routed.tile_rows, tiles, routed.offsets, routed.sorted_entries,
                  routed.positions, routed.tiles, routed.tile_count, done)


def interleave_gate_up(up):
    """A gated MLP's up [..., 2 W, K] (the gate's W rows, then the up's) as grouped_gemm(gated=True) takes it: rows
    interleaved by 8, the gate's rows 8 q .. 8 q + 7 then the up's. W % 8 == 0. Experts in FP8 (loading/fp8.py's
    Fp8Experts) stay FP8."""
    width = up.shape[-2] // 2
    require(up.shape[-2] % 16 == 0, f"moe gemm: a gated width {width} must be a multiple of 8")
    order = torch.arange(2 * width).view(2, width // 8, 8).transpose(0, 1).flatten()
    return up.rows(order) if isinstance(up, Fp8Experts) else up[..., order, :]


def grouped_gemm(lib, stream, out: DeviceTensor, a: DeviceTensor, weight: DeviceTensor | Fp8Matrix, routed: Routed,
                 gather_div: int, gated: bool = False, limit: float = 0.0) -> None:
    """out [entries, N] (rows in sorted order) = each row's a @ its expert's weight [E, N, K].T, bf16 with fp32
    accumulation: a's row sorted_entries[row] // gather_div (gather_div = top_k: x [T, K] by token) or, with
    gather_div 0, a's row `row` (a [entries, K] already sorted). K % 8 == 0, 16-byte aligned rows. gated: weight
    from interleave_gate_up, and out [entries, N / 2] = silu(gate) * up, the activation in the GEMM's epilogue
    (limit > 0: silu(min(gate, limit)) * clamp(up, -limit, limit), Hy4's clamped SwiGLU). An Fp8Matrix weight (e4m3
    [E, N, K] with scales [E, N], K % 16 == 0; in blocks, scales [E, K / 128, N], K % 128 == 0) is widened to the
    bf16 weight it dequantizes to (W8A16)."""
    fp8 = isinstance(weight, Fp8Matrix)
    data = weight.data if fp8 else weight
    experts, n, k = data.shape
    width = n // 2 if gated else n
    if fp8:
        blocks = weight.blocks
        columns, scales = (BLOCK, (experts, k // BLOCK, n)) if blocks else (16, (experts, n))
        require(data.dtype == "float8_e4m3" and data.is_contiguous and k % columns == 0
                and weight.scales.shape == scales and weight.scales.dtype == "float32"
                and weight.scales.is_contiguous,
                f"moe gemm: FP8 experts must be contiguous e4m3 [E, N, K] with K % {columns} == 0 and contiguous "
                f"scales {'[E, K / 128, N]' if blocks else '[E, N]'} float32, not {data.shape} {data.dtype} with "
                f"{weight.scales.shape}")
    else:
        require(weight.dtype == "bfloat16" and weight.is_contiguous, "moe gemm: weight must be contiguous bf16")
    require(a.dtype == "bfloat16" and len(a.shape) == 2 and a.shape[1] == k,
            f"moe gemm: a must be bf16 [*, {k}], not {a.shape} {a.dtype}")
    require(out.shape == (routed.entries, width) and out.dtype == "bfloat16" and out.is_contiguous,
            f"moe gemm: out must be contiguous bf16 [{routed.entries}, {width}]")
    require(k % 8 == 0 and n % (16 if gated else 2) == 0,
            f"moe gemm: K {k} must be a multiple of 8 and N {n} of {16 if gated else 2}")
    require((a.ptr | data.ptr | 2 * a.stride) % 16 == 0 and out.ptr % 4 == 0,
            "moe gemm: a and weight must be 16-byte aligned (pointer and row stride)")
    require(gather_div > 0 or a.shape[0] == routed.entries, "moe gemm: unsorted rows need gather_div")
    require(limit >= 0 and (gated or not limit), f"moe gemm: a clamp ({limit}) applies to a gated GEMM, at least 0")
    require(routed.tiles.shape[0] <= MAX_GRID_YZ, f"moe gemm: {routed.tiles.shape[0]} tiles (at most {MAX_GRID_YZ})")
    if routed.entries == 0:
        return
    tiles = routed.tiles.shape[0]
    weights = (data, weight.scales) if fp8 else (data,)
    suffix = ("_fp8_blocks" if weight.blocks else "_fp8") if fp8 else ""
    if routed.tile_rows >= 64:
        kernel = lib.get(TILE_ROWS[routed.tile_rows] + ("_gated" if gated else "") + suffix, MODULE)
        launch_kernel(stream, kernel, (ceil_div(n, GEMM_BN), tiles), GEMM_THREADS, out, a, np.int64(a.stride),
                      *weights, routed.sorted_entries, gather_div, routed.offsets, routed.tiles, routed.tile_count, n,
                      k, np.float32(limit))
    else:                   # the skinny GEMM: rows and K in 16-byte chunks
        kernel = lib.get(TILE_ROWS[routed.tile_rows] + suffix, MODULE)
        launch_kernel(stream, kernel, (ceil_div(n, SKINNY_ROWS), tiles), SKINNY_THREADS, out, a,
                      np.int64(a.stride // 8), *weights, routed.sorted_entries, gather_div, routed.offsets,
                      routed.tiles, routed.tile_count, n, k // 8, int(gated), np.float32(limit))


def combine(lib, stream, out: DeviceTensor, expert_out: DeviceTensor, routed: Routed,
            shared: DeviceTensor | None = None) -> None:
    """out [T, H] = each token's sum of weight * its experts' rows of expert_out [entries, H] (+ shared [T, H]),
    fp32, rounded once to bf16."""
    tokens, hidden = out.shape
    top_k = routed.weights.shape[1]
    require(out.dtype == "bfloat16" and out.is_contiguous and hidden % 2 == 0,
            "moe combine: out must be contiguous bf16 with an even width")
    require(expert_out.shape == (tokens * top_k, hidden) and expert_out.is_contiguous,
            f"moe combine: expert_out must be contiguous [{tokens * top_k}, {hidden}]")
    require(shared is None or (shared.shape == (tokens, hidden) and shared.is_contiguous),
            f"moe combine: shared must be contiguous [{tokens}, {hidden}]")
    require(tokens <= MAX_GRID_YZ, f"moe combine: {tokens} tokens (at most {MAX_GRID_YZ})")
    if tokens == 0:
        return
    grid = (ceil_div(hidden, 2 * COMBINE_THREADS), tokens)
    launch_kernel(stream, lib.get("moe_combine", MODULE), grid, COMBINE_THREADS, out, expert_out, routed.weights,
                  routed.positions, shared if shared is not None else NULL, hidden, top_k)
