"""Launchers for cuda_kernels/decode_attention.cu and decode_attention_mha.cu (split along the context,
flash-decoding) and prefill_attention.cu (flash-attention-2): causal attention over the paged KV cache."""

import functools
import math
from typing import NamedTuple

import numpy as np

from metrale.runtime.backend.cuda.kernels.rope_kv import kv_cache_scales
from metrale.runtime.backend.cuda.launch import MAX_GRID_YZ, ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.cuda.tensor_maps import paged_kv_map

DECODE_MODULE, MHA_MODULE, PREFILL_MODULE = "decode_attention", "decode_attention_mha", "prefill_attention"
HOPPER_MODULE = "prefill_attention_hopper"
HEAD_DIMS = (32, 64, 128)
BLOCK_SIZES = (16, 32, 64)     # powers of two dividing KV_TILE
THREADS = 128                  # as in attention_tiles.cuh: 4 warps
KV_TILE = 64                   # as in attention_tiles.cuh: keys per K/V tile
PREFILL_ROWS = 64              # as in attention_tiles.cuh: query rows per prefill CTA
# As in prefill_attention_hopper.cu: a loading and two computing warpgroups, 128 query rows a CTA, 128-key K/V
# tiles in 3 stages, rows in 64-column tiles of 128 bytes (1024-byte aligned).
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_THREADS, HOPPER_ROWS, HOPPER_KEYS, HOPPER_STAGES = 384, 128, 128, 3
MAX_DECODE_GROUP = 16          # decode: a kv group's query heads fill the 16 rows of one mma tile
MHA_WARPS = 4                  # as in decode_attention_mha.cu: heads (a warp each) per multi-head decode CTA
# decode: a split's fixed cost (query load, pipeline fill, the warps' merge, the partial write) in the time of
# one KV tile; fitted on an H200 to timings of 1 to 256 sequences x 1024 to 32768 keys (bench/gpu_attention.py).
SPLIT_OVERHEAD_TILES = 6
CONTEXT_QUANTUM = 4 * KV_TILE  # decode: max_context is planned in steps of this many keys
LOG2_E = math.log2(math.e)


class NewTokens(NamedTuple):
    """The decode rows' new tokens, for paged_decode_attention to rotate and write itself (multi-head models: in
    place of rope_and_write_kv and its launch): k, v [T, num_heads * head_dim] bf16 (column slices of qkv allowed,
    16-byte aligned rows); cos, sin [P, head_dim / 2] float32, or both None for a model without rotary
    embeddings (nothing rotated); positions, slots [T] int32, as rope_and_write_kv takes them."""
    k: DeviceTensor
    v: DeviceTensor
    cos: DeviceTensor | None
    sin: DeviceTensor | None
    positions: DeviceTensor
    slots: DeviceTensor


class QueryPartials(NamedTuple):
    """A multi-head decode launch's queries as their linear's split-K partials (the launch's q: [splits * T, width]
    float32, each slice's rows back to back, as CublasLt.linear(..., splits=) writes them), summed with the
    linear's bias ([width] bf16, or None) and rounded to bf16 as the linear's epilogue would."""
    splits: int
    bias: DeviceTensor | None


MAX_Q_PARTIALS = 8


def decode_partition(batch: int, num_kv_heads: int, max_context: int, resident_ctas: int) -> tuple[int, int]:
    """(keys per split, number of splits) of a decode launch. CTAs run in waves of resident_ctas; a split
    costs its tiles plus SPLIT_OVERHEAD_TILES. The choice minimizes waves x (tiles per split + overhead), the
    fewest splits among equals: one tile per split when everything fits one wave (batch 1), whole contexts
    per CTA when the sequences alone fill the device. max_context is rounded up to CONTEXT_QUANTUM first, so
    eager steps whose longest context grows token by token reuse one choice (splits past a context are empty)."""
    return _partition(batch, num_kv_heads, ceil_div(max(max_context, 1), CONTEXT_QUANTUM) * CONTEXT_QUANTUM,
                      resident_ctas)


@functools.lru_cache(maxsize=4096)
def _partition(batch: int, num_kv_heads: int, max_context: int, resident_ctas: int) -> tuple[int, int]:
    tiles = ceil_div(max_context, KV_TILE)
    groups = max(batch * num_kv_heads, 1)
    most = min(tiles, max_splits(groups, resident_ctas))
    best = None
    for splits in range(1, most + 1):
        per_split = ceil_div(tiles, splits)
        if ceil_div(tiles, per_split) != splits:
            continue   # the same partition as a smaller count
        cost = ceil_div(groups * splits, resident_ctas) * (per_split + SPLIT_OVERHEAD_TILES)
        if best is None or cost < best[0]:
            best = (cost, per_split * KV_TILE, splits)
    return best[1], best[2]


def max_splits(groups: int, resident_ctas: int) -> int:
    """The most splits decode_partition considers for groups (sequence, kv head) pairs. Past one wave every
    further split adds its overhead to some wave and saves less than that, so while the pairs alone do not fill
    the device, a few waves' worth (the full search finds nothing better: tested); once they do, 8 (more would
    only shave the rounding of waves, a few percent at most, and cost workspace)."""
    return 4 * ceil_div(resident_ctas, groups) + 16 if groups < resident_ctas else 8


def decode_workspace_bound(lib, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           max_context: int) -> int:
    """float32 elements that cover decode_workspace_elements for every batch <= max_batch and context <=
    max_context on this device: the memory plan's decode workspace."""
    require(head_dim in HEAD_DIMS, f"the CUDA attention kernels take head_dim {HEAD_DIMS}, not {head_dim}")
    slots = lib.resident_ctas(f"paged_decode_attention_hd{head_dim}", DECODE_MODULE, THREADS)
    tiles = ceil_div(ceil_div(max(max_context, 1), CONTEXT_QUANTUM) * CONTEXT_QUANTUM, KV_TILE)
    return max((b * num_heads * min(tiles, max_splits(b * num_kv_heads, slots)) * (head_dim + 1)
                for b in range(1, max_batch + 1)), default=0)


def decode_splits(lib, batch: int, num_kv_heads: int, head_dim: int, max_context: int,
                  partition: int | None = None) -> tuple[int, int]:
    """(keys per split, splits): decode_partition's choice for this device, or `partition` keys (a multiple of
    KV_TILE) when given."""
    if partition is None:
        slots = lib.resident_ctas(f"paged_decode_attention_hd{head_dim}", DECODE_MODULE, THREADS)
        return decode_partition(batch, num_kv_heads, max_context, slots)
    require(partition > 0 and partition % KV_TILE == 0, f"decode partition {partition} must be a multiple of {KV_TILE}")
    return partition, ceil_div(max(max_context, 1), partition)


def decode_workspace_elements(lib, batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_context: int,
                              partition: int | None = None) -> int:
    """float32 elements paged_decode_attention needs for these sizes (0 when the context is not split):
    each split's normalized output [B, num_heads, splits, head_dim] and log2-sum-exp [B, num_heads, splits]."""
    return _partials_elements(batch, num_heads, head_dim,
                              decode_splits(lib, batch, num_kv_heads, head_dim, max_context, partition)[1])


def _partials_elements(batch: int, num_heads: int, head_dim: int, splits: int) -> int:
    return 0 if splits == 1 else batch * num_heads * splits * (head_dim + 1)


def paged_decode_attention(lib, stream, out: DeviceTensor, q: DeviceTensor, kv_cache: DeviceTensor,
                           seq_rows: DeviceTensor, context_lens: DeviceTensor, block_tables: DeviceTensor,
                           workspace: DeviceTensor | None, num_heads: int, num_kv_heads: int, head_dim: int,
                           scale: float, sliding_window: int, max_context: int, partition: int | None = None,
                           new_tokens: NewTokens | None = None, q_partials: QueryPartials | None = None) -> None:
    """Attention of one query per sequence over its paged KV: for b < B, out[seq_rows[b]] (all heads) from
    q[seq_rows[b]] and keys 0 .. context_lens[b] - 1 (the last max(0, context - sliding_window) .. with a
    window) read through block_tables[b].

    out, q [T, num_heads * head_dim] bf16 (q may be a column slice; rows not in seq_rows are not touched);
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16, or an Fp8KvTensor (e4m3 values with their
    heads' scales: the grouped kernel's _fp8 entry, whatever the group size); seq_rows, context_lens [B] int32;
    block_tables [B, max_blocks] int32; workspace float32 of at least decode_workspace_elements(...)
    elements (read only when that is > 0; may be None then); sliding_window -1 for none. Not checked on the device (the caller
    guarantees): 1 <= context_lens[b] <= max_context <= max_blocks * block_size, block ids in [0, num_blocks),
    seq_rows in [0, T). A sequence with context_lens[b] == 0 (a padding row) leaves its row unwritten.
    The number of splits depends on B, num_kv_heads and max_context only, so a captured graph stays valid
    for any contexts up to max_context. partition: keys per split, overriding decode_partition (benchmarks).
    new_tokens (num_heads == num_kv_heads only): each sequence's newest key (context_lens[b] - 1) is its row's new
    token, rotated with its query and written into kv_cache here, rather than read from it. q_partials
    (num_heads == num_kv_heads only): q is the query's linear as split-K partials, [splits * T, width] float32.
    Neither with an FP8 cache."""
    fp8 = _check_common("paged_decode_attention", out, q if q_partials is None else out, kv_cache, block_tables,
                  num_heads, num_kv_heads, head_dim, sliding_window)
    require(len(seq_rows.shape) == 1 and seq_rows.dtype == "int32",
            "paged_decode_attention: seq_rows must be [B] int32")
    batch = seq_rows.shape[0]
    require(context_lens.shape == (batch,) and context_lens.dtype == "int32",
            f"paged_decode_attention: context_lens must be [{batch}] int32")
    require(block_tables.shape[0] == batch, f"paged_decode_attention: block_tables must have {batch} rows")
    require(num_heads // num_kv_heads <= MAX_DECODE_GROUP,
            f"paged_decode_attention: at most {MAX_DECODE_GROUP} query heads per kv head")
    block_size = kv_cache.shape[2]
    require(0 <= max_context <= block_tables.shape[1] * block_size,
            f"paged_decode_attention: max_context {max_context} exceeds the block tables' "
            f"{block_tables.shape[1]} blocks of {block_size}")
    require(batch <= MAX_GRID_YZ, f"paged_decode_attention: at most {MAX_GRID_YZ} sequences")
    if batch == 0 or max_context == 0:
        return
    partition, splits = decode_splits(lib, batch, num_kv_heads, head_dim, max_context, partition)
    needed = _partials_elements(batch, num_heads, head_dim, splits)
    partial_out = partial_lse = np.uint64(0)
    if needed:
        require(workspace is not None and workspace.dtype == "float32" and workspace.numel >= needed,
                f"paged_decode_attention: workspace must be float32 with at least {needed} elements")
        require(workspace.ptr % 16 == 0, "paged_decode_attention: workspace must be 16-byte aligned")
        partial_out = workspace
        partial_lse = np.uint64(workspace.ptr + batch * num_heads * splits * head_dim * 4)
    extra = ()          # the variant kernels' own arguments
    if new_tokens is not None:
        require(num_heads == num_kv_heads, "paged_decode_attention: new tokens need one query head per kv head")
        _check_new_tokens(new_tokens, q.shape[0], num_heads * head_dim, head_dim)
        k, v = new_tokens.k, new_tokens.v
        cos, sin = (np.uint64(0), np.uint64(0)) if new_tokens.cos is None else (new_tokens.cos, new_tokens.sin)
        extra = (k, np.int64(k.stride), v, np.int64(v.stride), cos, sin, new_tokens.positions, new_tokens.slots)
    if q_partials is not None:
        extra = _partial_query(q_partials, q, out, num_heads, num_kv_heads, new_tokens)
    if fp8 is not None:
        require(new_tokens is None and q_partials is None,
                "paged_decode_attention: an FP8 cache takes neither new tokens nor query partials")
        extra = (fp8,)
    if num_heads == num_kv_heads and fp8 is None:   # a warp per head: an mma tile would fill one row in 16
        name = ("paged_decode_attention_mha_partial_q" if q_partials is not None else
                "paged_decode_attention_mha_new" if new_tokens is not None else "paged_decode_attention_mha")
        kernel, grid, block, heads = (lib.get(f"{name}_hd{head_dim}", MHA_MODULE),
                                      (splits, ceil_div(num_heads, MHA_WARPS), batch), 32 * MHA_WARPS, num_heads)
    else:                           # the group's query heads share each K/V tile: the rows of one mma tile
        name = "paged_decode_attention_fp8" if fp8 is not None else "paged_decode_attention"
        kernel, grid, block, heads = (lib.get(f"{name}_hd{head_dim}", DECODE_MODULE),
                                      (splits, num_kv_heads, batch), THREADS, num_heads // num_kv_heads)
    launch_kernel(stream, kernel, grid, block, out, np.int64(out.stride), q, np.int64(q.stride), kv_cache,
                  np.int64(kv_cache.numel // 2), seq_rows, context_lens, block_tables, block_tables.shape[1],
                  partial_out, partial_lse, heads, block_size.bit_length() - 1, np.float32(scale * LOG2_E),
                  sliding_window, partition, *extra)
    if splits > 1:
        launch_kernel(stream, lib.get("paged_decode_reduce", DECODE_MODULE), (num_heads, batch), head_dim, out,
                      np.int64(out.stride), seq_rows, context_lens, partial_out, partial_lse, np.uint64(0),
                      sliding_window, partition, splits)


def _partial_query(partials: QueryPartials, q: DeviceTensor, out: DeviceTensor, num_heads: int, num_kv_heads: int,
                   new_tokens: NewTokens | None) -> tuple:
    """The partial-query kernel's extra arguments, checked: q is [splits * T, width] float32, contiguous."""
    require(num_heads == num_kv_heads and new_tokens is None,
            "paged_decode_attention: query partials need one query head per kv head and no new tokens")
    require(1 <= partials.splits <= MAX_Q_PARTIALS, f"paged_decode_attention: 1 to {MAX_Q_PARTIALS} query partials")
    rows, width = out.shape
    require(q.dtype == "float32" and q.is_contiguous and q.shape == (partials.splits * rows, width),
            f"paged_decode_attention: query partials must be [{partials.splits * rows}, {width}] float32, contiguous")
    if partials.bias is not None:
        require(partials.bias.dtype == "bfloat16" and partials.bias.shape == (width,) and partials.bias.is_contiguous,
                f"paged_decode_attention: the query's bias must be [{width}] bfloat16")
    return (q, np.int64(rows * width), partials.splits, np.uint64(0) if partials.bias is None else partials.bias)


def _check_new_tokens(new: NewTokens, rows: int, width: int, head_dim: int) -> None:
    for name, tensor in (("k", new.k), ("v", new.v)):
        require(tensor.dtype == "bfloat16" and tensor.shape == (rows, width),
                f"paged_decode_attention: new tokens' {name} must be [{rows}, {width}] bfloat16, not {tensor.shape} "
                f"{tensor.dtype}")
        require_aligned(tensor, 16, f"paged_decode_attention: new tokens' {name}")
    require((new.cos is None) == (new.sin is None), "paged_decode_attention: new tokens' cos and sin go together")
    for name, table in (("cos", new.cos), ("sin", new.sin)) if new.cos is not None else ():
        require(table.dtype == "float32" and len(table.shape) == 2 and table.shape[1] == head_dim // 2
                and table.is_contiguous and table.ptr % 16 == 0,
                f"paged_decode_attention: {name} must be a 16-byte aligned [P, {head_dim // 2}] float32")
    for name, array in (("positions", new.positions), ("slots", new.slots)):
        require(array.dtype == "int32" and len(array.shape) == 1 and array.shape[0] >= rows,
                f"paged_decode_attention: new tokens' {name} must be [>= {rows}] int32")


def paged_prefill_attention(lib, stream, out: DeviceTensor, q: DeviceTensor, kv_cache: DeviceTensor,
                            query_starts: DeviceTensor, query_lens: DeviceTensor, context_lens: DeviceTensor,
                            block_tables: DeviceTensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                            sliding_window: int, num_segments: int, max_query_len: int, causal: bool = True,
                            hopper: bool | None = None, tma: bool = True) -> None:
    """Causal attention of each segment's queries over its paged KV: segment s owns rows
    query_starts[s] .. + query_lens[s] of q and out, the queries at the last query_lens[s] positions of its
    context_lens[s] keys (earlier chunks and the new tokens, all already in kv_cache), read through
    block_tables[s]; sliding_window -1 for none. causal=False: every query sees all context_lens[s] keys (an
    encoder's self-attention, a decoder's cross-attention), with no sliding window and any query_lens[s].

    out, q [T, num_heads * head_dim] bf16 (q may be a column slice; rows outside the segments are not
    touched); kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16, or an Fp8KvTensor (e4m3 values
    with their heads' scales: prefill_attention.cu's _fp8 kernel, on Hopper too); query_starts, query_lens,
    context_lens [S] int32, S >= num_segments; block_tables [S, max_blocks] int32. Not checked on the device
    (the caller guarantees): 0 <= query_lens[s] <= max_query_len, query_lens[s] <= context_lens[s]
    <= max_blocks * block_size, block ids in [0, num_blocks), segment rows inside [0, T).
    hopper: run prefill_attention_hopper.cu's wgmma kernel (None: wherever the device is sm_90a and the head dim one
    it builds; False: prefill_attention.cu's, for comparison); tma: the Hopper kernel loads the K/V tiles with keys
    only inside the context through the cache's tensor map (tensor_maps.paged_kv_map; False: with cp.async, as it
    loads the others, for comparison)."""
    fp8 = _check_common("paged_prefill_attention", out, q, kv_cache, block_tables, num_heads, num_kv_heads, head_dim,
                        sliding_window)
    for name, tensor in (("query_starts", query_starts), ("query_lens", query_lens), ("context_lens", context_lens)):
        require(len(tensor.shape) == 1 and tensor.shape[0] >= num_segments and tensor.dtype == "int32",
                f"paged_prefill_attention: {name} must be [S >= {num_segments}] int32")
    require(block_tables.shape[0] >= num_segments,
            f"paged_prefill_attention: block_tables must have at least {num_segments} rows")
    available = hopper_prefill_available(lib.arch, head_dim) and fp8 is None
    require(not hopper or available, f"paged_prefill_attention: no Hopper kernel for {lib.arch}, head_dim {head_dim}")
    require(num_segments <= MAX_GRID_YZ and num_heads <= MAX_GRID_YZ,
            f"paged_prefill_attention: at most {MAX_GRID_YZ} segments and heads")
    require(max_query_len >= 0, "paged_prefill_attention: max_query_len must be >= 0")
    require(causal or sliding_window == -1, "paged_prefill_attention: a sliding window needs causal attention")
    if num_segments == 0 or max_query_len == 0:
        return
    block_size = kv_cache.shape[2]
    args = (out, np.int64(out.stride), q, np.int64(q.stride), kv_cache, np.int64(kv_cache.numel // 2), query_starts,
            query_lens, context_lens, block_tables, block_tables.shape[1], num_kv_heads, num_heads // num_kv_heads,
            block_size.bit_length() - 1, np.float32(scale * LOG2_E), sliding_window, int(causal))
    if available and hopper is not False:
        shared = hopper_prefill_shared_bytes(head_dim)
        kernel = lib.get_with_shared(f"paged_prefill_attention_hopper_hd{head_dim}", HOPPER_MODULE, shared)
        kv_map = np.uint64(paged_kv_map(kv_cache) if tma else 0)
        launch_kernel(stream, kernel, (ceil_div(max_query_len, HOPPER_ROWS), num_heads, num_segments),
                      HOPPER_THREADS, *args, kv_map, shmem=shared)
        return
    name = "paged_prefill_attention_fp8" if fp8 is not None else "paged_prefill_attention"
    launch_kernel(stream, lib.get(f"{name}_hd{head_dim}", PREFILL_MODULE),
                  (ceil_div(max_query_len, PREFILL_ROWS), num_heads, num_segments), THREADS, *args,
                  np.uint64(0) if fp8 is None else fp8)


def hopper_prefill_available(arch: str, head_dim: int) -> bool:
    """Whether paged_prefill_attention runs prefill_attention_hopper.cu here (which loads through tensor maps)."""
    return arch == "sm_90a" and head_dim in HOPPER_HEAD_DIMS


def hopper_prefill_shared_bytes(head_dim: int) -> int:
    """HopperTiles<head_dim>::SHARED_BYTES: the alignment slack, the Q tile, the K/V stages, their barriers and a
    gathered tile's key tokens."""
    row_parts = head_dim // 64
    tiles = row_parts * 128 * (HOPPER_ROWS + 2 * HOPPER_STAGES * HOPPER_KEYS)
    return 1024 + tiles + 16 * HOPPER_STAGES + 4 * HOPPER_KEYS


def _check_common(name: str, out: DeviceTensor, q: DeviceTensor, kv_cache: DeviceTensor, block_tables: DeviceTensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int) -> DeviceTensor | None:
    """The checks both launchers share; returns an FP8 cache's scales (None for bf16)."""
    require(head_dim in HEAD_DIMS, f"{name}: head_dim {head_dim} is not one of {HEAD_DIMS}")
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            f"{name}: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    width = num_heads * head_dim
    require(q.dtype == "bfloat16" and len(q.shape) == 2 and q.shape[1] == width,
            f"{name}: q must be [T, {width}] bfloat16, not {q.shape} {q.dtype}")
    require(out.dtype == "bfloat16" and out.shape == q.shape, f"{name}: out must be bfloat16 of q's shape {q.shape}")
    fp8 = kv_cache_scales(kv_cache, name)
    require(len(kv_cache.shape) == 5 and kv_cache.shape[0] == 2
            and kv_cache.shape[3:] == (num_kv_heads, head_dim) and kv_cache.is_contiguous,
            f"{name}: kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], not {kv_cache.shape}")
    require(kv_cache.shape[2] in BLOCK_SIZES, f"{name}: block_size {kv_cache.shape[2]} is not one of {BLOCK_SIZES}")
    require(len(block_tables.shape) == 2 and block_tables.dtype == "int32",
            f"{name}: block_tables must be [S, max_blocks] int32")
    require(sliding_window == -1 or sliding_window >= 1, f"{name}: sliding_window must be -1 (none) or >= 1")
    require_aligned(q, 16, f"{name}: q")
    require_aligned(out, 4, f"{name}: out")
    require(kv_cache.ptr % 16 == 0, f"{name}: kv_cache must be 16-byte aligned")
    require(block_tables.ptr % 4 == 0, f"{name}: block_tables must be 4-byte aligned")
    return fp8


# Multi-head latent attention's up-projected prefill: the (nope, rope, v) head dims prefill_attention.cu builds.
LATENT_PREFILL_DIMS = ((128, 64, 128), (64, 32, 64), (32, 16, 16))


class LatentPiece(NamedTuple):
    """Where one piece of the prefill segments' contexts lies (latent_prefill_attention): segment s's keys
    key_lo[s] .. key_hi[s] at workspace rows row_starts[s] .., int32 [S] each, on the device."""
    key_lo: DeviceTensor
    key_hi: DeviceTensor
    row_starts: DeviceTensor


def latent_prefill_shared_bytes(nope: int, rope: int, v: int) -> int:
    """LatentPrefill<NOPE, ROPE, V>::SHARED_BYTES: the K tile, then the Q tile or the V tile."""
    qk_stride, v_stride = nope + rope + 8, v + 8
    return 2 * KV_TILE * (qk_stride + max(qk_stride, v_stride))


def latent_prefill_attention(lib, stream, out: DeviceTensor, merged: tuple[DeviceTensor, DeviceTensor] | None,
                             q_nope: DeviceTensor, q_head_stride: int, q_rope: DeviceTensor, rope_q_head_stride: int,
                             k_nope: DeviceTensor, values: DeviceTensor, rope_keys: DeviceTensor,
                             query_starts: DeviceTensor, query_lens: DeviceTensor, context_lens: DeviceTensor,
                             piece: LatentPiece, heads: int, scale: float, num_segments: int, max_query_len: int,
                             first: bool, last: bool) -> None:
    """Causal attention of each prefill segment's queries (as paged_prefill_attention's segments) over one piece
    of its context. Query row t of head h: q_nope's head-h columns [T, nope] (head h's q_head_stride elements on),
    then q_rope's [T, rope] (its rotated rotary part, rope_q_head_stride apart). The piece's keys, up-projected, in
    workspace rows (LatentPiece): k_nope [rows, heads * nope], values [rows, heads * v], rope_keys [rows, rope] (any
    row stride: every head's rotary key). The pieces of a context merge through `merged` (acc [T, heads * v] and
    lse [T, heads], float32): the first piece writes them, the last writes out [T, heads * v] bf16; one piece
    (first and last) needs none."""
    nope, v = k_nope.shape[1] // heads, values.shape[1] // heads
    rope = rope_keys.shape[1]
    require((nope, rope, v) in LATENT_PREFILL_DIMS,
            f"latent prefill attention: head dims {(nope, rope, v)} are not built (only {LATENT_PREFILL_DIMS})")
    tokens = q_nope.shape[0]
    for name, tensor, width, head_stride in (("q_nope", q_nope, nope, q_head_stride),
                                             ("q_rope", q_rope, rope, rope_q_head_stride)):
        require(tensor.dtype == "bfloat16" and tensor.shape == (tokens, width) and tensor.ptr % 16 == 0
                and tensor.stride % 8 == 0 and head_stride % 8 == 0
                and (heads - 1) * head_stride + width <= tensor.stride,
                f"latent prefill attention: {name} must be 16-byte aligned bf16 [T, {width}] columns of rows "
                f"holding {heads} heads")
    require(out.dtype == "bfloat16" and out.shape == (tokens, heads * v) and out.stride % 2 == 0,
            f"latent prefill attention: out must be bf16 [{tokens}, {heads * v}]")
    for name, tensor in (("k_nope", k_nope), ("values", values), ("rope_keys", rope_keys)):
        require(tensor.dtype == "bfloat16" and tensor.ptr % 16 == 0 and tensor.stride % 8 == 0,
                f"latent prefill attention: {name} must be 16-byte aligned bf16 rows")
    require(k_nope.is_contiguous and values.is_contiguous and k_nope.shape[0] == values.shape[0]
            and rope_keys.shape[0] >= k_nope.shape[0],
            "latent prefill attention: k_nope and values must be contiguous, one row a key (rope_keys' too)")
    require(merged is not None or (first and last), "latent prefill attention: several pieces need acc and lse")
    acc, lse = merged if merged is not None else (None, None)
    if merged is not None:
        require(acc.dtype == "float32" and acc.shape == (tokens, heads * v) and acc.is_contiguous
                and lse.dtype == "float32" and lse.shape == (tokens, heads) and lse.is_contiguous,
                f"latent prefill attention: acc and lse must be contiguous float32 [T, {heads * v}] and [T, {heads}]")
    require(num_segments <= MAX_GRID_YZ and heads <= MAX_GRID_YZ,
            f"latent prefill attention: at most {MAX_GRID_YZ} segments and heads")
    if num_segments == 0 or max_query_len == 0:
        return
    shared = latent_prefill_shared_bytes(nope, rope, v)
    kernel = lib.get_with_shared(f"latent_prefill_attention_n{nope}_r{rope}_v{v}", PREFILL_MODULE, shared)
    null = np.uint64(0)
    launch_kernel(stream, kernel, (ceil_div(max_query_len, PREFILL_ROWS), heads, num_segments), THREADS, out,
                  np.int64(out.stride), null if acc is None else acc, null if lse is None else lse, q_nope,
                  np.int64(q_nope.stride), q_head_stride, q_rope, np.int64(q_rope.stride), rope_q_head_stride, k_nope,
                  values, rope_keys, rope_keys.stride, query_starts, query_lens, context_lens, piece.key_lo,
                  piece.key_hi, piece.row_starts, heads, np.float32(scale * LOG2_E), int(first), int(last),
                  shmem=shared)
