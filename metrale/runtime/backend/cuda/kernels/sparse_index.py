"""Launchers for cuda_kernels/sparse_index.cu and index_top_k.cu, DeepSeek sparse attention's indexer: the rotary
parts of its queries and keys with the index key cache write (rope_and_write), each token's per-head weights
(weights), each query's scores over its causal context (scores), and the top-k tokens of each row of scores
(top_k). The caller holds the float32 scratch between them (scratch_elements); nothing here allocates or waits on
the host."""

from typing import NamedTuple

import numpy as np

from metrale.runtime.backend.cuda.launch import MAX_GRID_YZ, ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "sparse_index"
TOP_K_MODULE = "index_top_k"
ROPE_THREADS = 256
WEIGHT_TOKENS, WEIGHT_WARPS = 8, 8  # index_weights' tokens a CTA, and its warps (each a slice of a head's row)
THREADS = 128                       # index_scores': attention_tiles.cuh's
SCORE_TILE = 128                    # keys a tile of index_scores
MAX_CHUNK_TILES = 8                 # tiles a CTA of index_scores at most
TARGET_CTAS = 1024                  # index_scores' CTAs worth splitting a context for (about 4 waves on an H200)
HEAD_DIMS = (32, 64, 128)           # the head sizes index_scores is built for
MAX_HEADS = 128
TOP_K_THREADS = 512
# The most keys index_top_k holds in shared memory, by architecture (its opt-in shared memory less the 8 KB
# histogram): a whole row up to it, one read of the scores. Hopper: 192 KB, 32k-token contexts whole.
STAGED = {"sm_90": 49152, "sm_90a": 49152, "sm_80": 36864}
STAGED_ELSE = 20480                 # sm_86, sm_89: 99 KB a block
NULL = np.uint64(0)


class Scratch(NamedTuple):
    """float32 elements the caller preallocates: weights' out [tokens, heads] and scores' out [entries,
    max_context]. rope_and_write and top_k need none."""
    weights: int
    scores: int


def scratch_elements(tokens: int, entries: int, heads: int, max_context: int) -> Scratch:
    return Scratch(tokens * heads, entries * max_context)


def rope_and_write(lib, stream, q: DeviceTensor, k: DeviceTensor, cos: DeviceTensor, sin: DeviceTensor,
                   positions: DeviceTensor, slot_mapping: DeviceTensor, cache: DeviceTensor, heads: int,
                   head_dim: int, rope_dim: int, rope_first: bool) -> None:
    """q [T, heads * head_dim] bf16 rotated in place and k [T, head_dim] bf16 rotated into cache row
    slot_mapping[t] (int32; none where negative; k itself unchanged), each head's rotary part its first rope_dim
    dims (rope_first) or its last, rotate-half, at positions [T] int32 of cos, sin [P, rope_dim / 2] float32.
    cache: the index key cache, contiguous bf16 [num_slots, head_dim] (or [blocks, block_size, head_dim])."""
    tokens = q.shape[0]
    require(heads > 0 and 0 < rope_dim <= head_dim and rope_dim % 4 == 0 and head_dim % 2 == 0,
            f"index rope: rope_dim {rope_dim} must be a positive multiple of 4 within head_dim {head_dim}")
    require(q.dtype == "bfloat16" and len(q.shape) == 2 and q.shape[1] == heads * head_dim,
            f"index rope: q must be [T, {heads * head_dim}] bf16, not {q.shape} {q.dtype}")
    require(k.dtype == "bfloat16" and k.shape == (tokens, head_dim),
            f"index rope: k must be [{tokens}, {head_dim}] bf16, not {k.shape} {k.dtype}")
    require_aligned(q, 4, "index rope: q")
    require_aligned(k, 4, "index rope: k")
    for name, table in (("cos", cos), ("sin", sin)):
        require(table.dtype == "float32" and len(table.shape) == 2 and table.shape[1] == rope_dim // 2
                and table.is_contiguous and table.ptr % 8 == 0,
                f"index rope: {name} must be contiguous 8-byte aligned float32 [P, {rope_dim // 2}]")
    for name, meta in (("positions", positions), ("slot_mapping", slot_mapping)):
        require(meta.dtype == "int32" and meta.shape == (tokens,), f"index rope: {name} must be [{tokens}] int32")
    _require_cache(cache, head_dim, 4, "index rope")
    if tokens == 0:
        return
    launch_kernel(stream, lib.get("rope_and_write_index", MODULE), tokens, ROPE_THREADS, q, np.int64(q.stride), k,
                  np.int64(k.stride), cos, sin, positions, slot_mapping, cache, heads, head_dim, rope_dim,
                  int(rope_first))


def weights(lib, stream, out: DeviceTensor, x: DeviceTensor, weights_proj: DeviceTensor, scale: float) -> None:
    """out [T, heads] float32 = (x [T, hidden] bf16 @ weights_proj [heads, hidden].T float32) * scale, in float32
    (SparseIndexer's weights: scale = its weight_scale)."""
    require(x.dtype == "bfloat16" and len(x.shape) == 2 and x.shape[1] % 4 == 0,
            f"index weights: x must be bf16 [T, hidden], hidden a multiple of 4, not {x.shape} {x.dtype}")
    (tokens, hidden), heads = x.shape, weights_proj.shape[0]
    require_aligned(x, 8, "index weights: x")
    require(weights_proj.dtype == "float32" and weights_proj.shape == (heads, hidden) and weights_proj.is_contiguous
            and weights_proj.ptr % 16 == 0, f"index weights: weights_proj must be contiguous 16-byte aligned float32 "
                                            f"[heads, {hidden}]")
    require(out.dtype == "float32" and out.shape == (tokens, heads),
            f"index weights: out must be [{tokens}, {heads}] float32, not {out.shape} {out.dtype}")
    require(0 < heads <= MAX_GRID_YZ, f"index weights: {heads} heads")
    if tokens == 0:
        return
    launch_kernel(stream, lib.get("index_weights", MODULE), (ceil_div(tokens, WEIGHT_TOKENS), heads),
                  32 * WEIGHT_WARPS, out, np.int64(out.stride), x, np.int64(x.stride),
                  weights_proj, tokens, heads, hidden, float(scale))


def scores_shared_bytes(head_dim: int, heads: int) -> int:
    """index_scores' dynamic shared memory: two key tiles and the query's heads padded to 16, rows of head_dim + 8."""
    return (2 * SCORE_TILE + 16 * ceil_div(heads, 16)) * (head_dim + 8) * 2


def chunk_tiles(entries: int, max_context: int) -> int:
    """Key tiles a CTA of index_scores takes: contexts split until there are about TARGET_CTAS CTAs, at most
    MAX_CHUNK_TILES tiles (one staging of the query per 1024 keys)."""
    tiles = ceil_div(max(max_context, 1), SCORE_TILE)
    return max(1, min(MAX_CHUNK_TILES, tiles, tiles * entries // TARGET_CTAS))


def scores(lib, stream, out: DeviceTensor, q: DeviceTensor, weights: DeviceTensor, cache: DeviceTensor,
           rows: DeviceTensor, contexts: DeviceTensor, tables: DeviceTensor, table_rows: DeviceTensor | None,
           block_size: int, max_context: int) -> None:
    """out [R, >= max_context] float32: entry r's score of key j = sum_h weights[rows[r], h] * relu(q[rows[r], h] .
    k_j) (q [T, heads * head_dim] bf16, weights [T, heads] float32), over the keys j < contexts[r] (int32 [R]) of the
    sequence whose block table is row table_rows[r] of tables (int32 [S, max_blocks]; None: row r); -inf for
    contexts[r] <= j < max_context (contexts past it count as max_context); columns from max_context on untouched.
    cache: the index key cache, contiguous bf16 [num_slots, head_dim] (head_dim in HEAD_DIMS), block_size a power of
    two. heads: weights' columns, 1 .. 128 (padded to 16 on the tensor cores)."""
    entries, heads = rows.shape[0], weights.shape[1]
    head_dim = cache.shape[-1]
    require(head_dim in HEAD_DIMS, f"index scores: head_dim {head_dim} is not built (only {HEAD_DIMS})")
    require(0 < heads <= MAX_HEADS, f"index scores: {heads} heads (at most {MAX_HEADS})")
    require(q.dtype == "bfloat16" and len(q.shape) == 2 and q.shape[1] == heads * head_dim,
            f"index scores: q must be [T, {heads * head_dim}] bf16, not {q.shape} {q.dtype}")
    require_aligned(q, 16, "index scores: q")
    require(weights.dtype == "float32" and weights.shape[0] == q.shape[0],
            f"index scores: weights must be [{q.shape[0]}, heads] float32, not {weights.shape} {weights.dtype}")
    _require_cache(cache, head_dim, 16, "index scores")
    require(block_size > 0 and block_size & (block_size - 1) == 0,
            f"index scores: block size {block_size} must be a power of two")
    require(rows.dtype == contexts.dtype == "int32" and len(rows.shape) == 1 and contexts.shape == (entries,)
            and (table_rows is None or (table_rows.dtype == "int32" and table_rows.shape == (entries,))),
            f"index scores: rows, contexts and table_rows must be [{entries}] int32")
    require(tables.dtype == "int32" and len(tables.shape) == 2 and tables.is_contiguous,
            "index scores: tables must be contiguous int32 [S, max_blocks]")
    require(out.dtype == "float32" and len(out.shape) == 2 and out.shape[0] == entries and out.shape[1] >= max_context,
            f"index scores: out must be float32 [{entries}, >= {max_context}], not {out.shape} {out.dtype}")
    require(max_context >= 0, f"index scores: max_context {max_context} must not be negative")
    chunk = chunk_tiles(entries, max_context) * SCORE_TILE
    chunks = ceil_div(max_context, chunk)
    require(chunks <= MAX_GRID_YZ, f"index scores: max_context {max_context} past the grid")
    if entries == 0 or max_context == 0:
        return
    shared = scores_shared_bytes(head_dim, heads)
    kernel = lib.get_with_shared(f"index_scores_d{head_dim}", MODULE, shared)
    launch_kernel(stream, kernel, (entries, chunks), THREADS, out, np.int64(out.stride), q, np.int64(q.stride),
                  weights, np.int64(weights.stride), cache, rows, contexts, tables,
                  NULL if table_rows is None else table_rows, tables.shape[1], heads, block_size.bit_length() - 1,
                  max_context, chunk, shmem=shared)


def top_k_capacity(arch: str, columns: int) -> int:
    """The keys index_top_k holds in shared memory for rows of `columns` scores (4 bytes each)."""
    return max(1, min(STAGED.get(arch, STAGED_ELSE), columns))


def top_k(lib, stream, indices: DeviceTensor, counts: DeviceTensor, scores: DeviceTensor, contexts: DeviceTensor,
          k: int) -> None:
    """indices [R, k] int32: row r's columns of its min(k, n) highest scores among its first n = contexts[r] of
    scores [R, columns] float32 (contexts past columns count as columns), in ascending column order, then -1; ties
    at the k-th highest score go to the lower column. counts [R] int32 = min(k, n)."""
    require(k > 0, f"index top-k: k {k} must be positive")
    require(scores.dtype == "float32" and len(scores.shape) == 2, "index top-k: scores must be float32 [R, columns]")
    entries, columns = scores.shape
    require(indices.dtype == "int32" and indices.shape == (entries, k),
            f"index top-k: indices must be [{entries}, {k}] int32, not {indices.shape} {indices.dtype}")
    for name, meta in (("counts", counts), ("contexts", contexts)):
        require(meta.dtype == "int32" and meta.shape == (entries,), f"index top-k: {name} must be [{entries}] int32")
    if entries == 0:
        return
    capacity = top_k_capacity(lib.arch, columns)
    kernel = lib.get_with_shared("index_top_k", TOP_K_MODULE, 4 * capacity)
    launch_kernel(stream, kernel, entries, TOP_K_THREADS, indices, np.int64(indices.stride), counts, scores,
                  np.int64(scores.stride), contexts, columns, k, capacity, shmem=4 * capacity)


def _require_cache(cache: DeviceTensor, head_dim: int, alignment: int, what: str) -> None:
    require(cache.dtype == "bfloat16" and len(cache.shape) in (2, 3) and cache.shape[-1] == head_dim
            and cache.is_contiguous and cache.ptr % alignment == 0,
            f"{what}: cache must be contiguous {alignment}-byte aligned bf16 [slots, {head_dim}], not {cache.shape}")
