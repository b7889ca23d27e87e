"""Launchers for cuda_kernels/latent_attention.cu: multi-head latent attention's rotary parts and cache rows
(rope_and_write_latent), and its attention in the latent space over the paged latent cache, one query token an
entry (latent_decode_attention; several splits of a long context merged by paged_decode_reduce), over a prefix of
each context or (DeepSeek sparse attention) a list of selected positions, with or without attention sinks."""

import numpy as np

from metrale.runtime.backend.cuda.kernels import attention
from metrale.runtime.backend.cuda.launch import MAX_GRID_YZ, ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "latent_attention"
TILE, ROWS = 32, 16                 # latent_attention.cu's LATENT_TILE (tokens a tile) and LATENT_ROWS (heads a CTA)
SHAPES = ((512, 64), (256, 32), (32, 16))    # the (rank, rope) pairs it is built for
THREADS = 128                       # attention_tiles.cuh's
ROPE_THREADS = 128
LOG2_E = 1.4426950408889634
NULL = np.uint64(0)


def kernel_name(rank: int, rope: int, selected: bool = False) -> str:
    return f"latent_decode_attention{'_selected' if selected else ''}_r{rank}_p{rope}"


def shared_bytes(rank: int, rope: int) -> int:
    """Latent<RANK, ROPE>::SHARED_BYTES: two token tiles and the query rows (bf16), the warps' partial scores of a
    tile (fp32)."""
    stride = rank + rope + 8
    return 2 * (2 * TILE * stride + ROWS * stride) + THREADS // 32 * 4 * ROWS * TILE


def supports(rank: int, rope: int) -> bool:
    return (rank, rope) in SHAPES


def rope_and_write(lib, stream, out: DeviceTensor, out_head_stride: int, q_rope: DeviceTensor, q_head_stride: int,
                   latent: DeviceTensor, rope_key: DeviceTensor, cos: DeviceTensor, sin: DeviceTensor,
                   positions: DeviceTensor, slot_mapping: DeviceTensor, cache: DeviceTensor, heads: int) -> None:
    """out's head h columns [T, rope] = q_rope's head h columns rotated at positions (rotate-half); cache row
    slot_mapping[t] = latent[t] then rope_key[t] rotated. out and q_rope: head 0's columns of rows holding every
    head's, head h's out_head_stride and q_head_stride elements on. cache [slots, rank + rope]."""
    tokens, rank = latent.shape
    rope = rope_key.shape[1]
    require(rope % 2 == 0 and cos.shape[1] == rope // 2 and sin.shape == cos.shape,
            f"rope and write latent: cos and sin must be [P, {rope // 2}]")
    require(cache.shape[1:] == (rank + rope,) and cache.dtype == "bfloat16" and cache.is_contiguous,
            f"rope and write latent: cache must be contiguous bf16 [slots, {rank + rope}]")
    require(q_rope.shape == (tokens, rope) and out.shape == (tokens, rope) and rope_key.shape == (tokens, rope),
            f"rope and write latent: q_rope, out and rope_key must be [{tokens}, {rope}] (head 0's columns)")
    require((heads - 1) * q_head_stride + rope <= q_rope.stride and (heads - 1) * out_head_stride + rope <= out.stride,
            f"rope and write latent: {heads} heads do not fit in rows of q_rope and out")
    require(positions.shape == (tokens,) and slot_mapping.shape == (tokens,),
            f"rope and write latent: positions and slot_mapping must be [{tokens}]")
    if tokens == 0:
        return
    launch_kernel(stream, lib.get("rope_and_write_latent", MODULE), tokens, ROPE_THREADS, out, np.int64(out.stride),
                  out_head_stride, q_rope, np.int64(q_rope.stride), q_head_stride, latent, np.int64(latent.stride),
                  rope_key, np.int64(rope_key.stride), cos, sin, positions, slot_mapping, cache, heads, rank, rope)


def partials_elements(entries: int, heads: int, rank: int, splits: int) -> int:
    """float32 elements latent_decode needs in `partials` for `splits` splits: outputs, then log-sum-exps."""
    return entries * heads * splits * (rank + 1)


def workspace_bound(lib, max_batch: int, heads: int, rank: int, rope: int, max_context: int) -> int:
    """float32 elements of partials that cover every decode launch of at most max_batch entries over contexts up
    to max_context: the most splits partition_for may choose for each batch (as attention.decode_workspace_bound
    bounds the decode attention's), with or without a selection (each kernel's resident CTAs; more: more splits)."""
    slots = max(lib.resident_ctas(kernel_name(rank, rope, selected), MODULE, THREADS, shared_bytes(rank, rope))
                for selected in (False, True))
    quantum = attention.CONTEXT_QUANTUM
    tiles = ceil_div(ceil_div(max(max_context, 1), quantum) * quantum, attention.KV_TILE)
    groups = ceil_div(heads, ROWS)
    return max((partials_elements(b, heads, rank, min(tiles, attention.max_splits(b * groups, slots)))
                for b in range(1, max_batch + 1)), default=0)


def partition_for(lib, entries: int, heads: int, max_context: int, rank: int, rope: int,
                  selected: bool = False) -> tuple[int, int]:
    """(tokens a split, splits) for `entries` queries of `heads` heads over contexts (selected: lists) up to
    max_context: as the decode attention kernels choose theirs (attention.decode_partition), a CTA's 16 heads
    standing for a kv head."""
    slots = lib.resident_ctas(kernel_name(rank, rope, selected), MODULE, THREADS, shared_bytes(rank, rope))
    return attention.decode_partition(entries, ceil_div(heads, ROWS), max_context, slots)


def decode(lib, stream, out: DeviceTensor, q: DeviceTensor, cache: DeviceTensor, rows: DeviceTensor,
           contexts: DeviceTensor, tables: DeviceTensor, table_rows: DeviceTensor | None, partials: DeviceTensor,
           heads: int, block_size: int, scale: float, max_context: int, partition: int | None = None,
           selected: DeviceTensor | None = None, selected_counts: DeviceTensor | None = None,
           sinks: DeviceTensor | None = None) -> None:
    """out [T, heads * rank] (each entry's row `rows[i]`) = each head's attention, in the latent space, of its query
    q [T, heads * (rank + rope)] over the first contexts[i] cached rows of the sequence whose block table is row
    table_rows[i] of tables (None: row i); contexts up to max_context, split in pieces of `partition` tokens (a
    multiple of 32; None: partition_for's) whose float32 partials go to `partials` (partials_elements) and are
    merged by paged_decode_reduce.

    selected [entries, width] int32 with selected_counts [entries] int32: entry i attends the tokens at positions
    selected[i, :selected_counts[i]] (ascending, each below contexts[i]) instead; max_context is then the longest
    list (at most width), and the splits cut the lists. sinks [heads] float32: each head's sink logit (natural log,
    not scaled), exp(sink) added to its softmax's denominator. An entry with no tokens (a count or context of 0)
    leaves its row unwritten."""
    entries = rows.shape[0]
    rank, rope = _shape(out, q, cache, heads)
    require(block_size & (block_size - 1) == 0, f"latent attention: block size {block_size} must be a power of two")
    _check_selection(selected, selected_counts, sinks, entries, heads, max_context)
    if partition is None:
        partition = partition_for(lib, entries, heads, max_context, rank, rope, selected is not None)[0]
    require(partition > 0 and partition % TILE == 0, f"latent attention: partition {partition} must be a multiple "
                                                     f"of {TILE}")
    require(contexts.shape == (entries,) and (table_rows is None or table_rows.shape == (entries,))
            and len(tables.shape) == 2, f"latent attention: contexts and table_rows must be [{entries}], tables 2-D")
    splits = ceil_div(max(max_context, 1), partition)
    require(partials.dtype == "float32" and partials.numel >= partials_elements(entries, heads, rank, splits),
            f"latent attention: partials must hold {partials_elements(entries, heads, rank, splits)} float32")
    require(entries <= MAX_GRID_YZ and ceil_div(heads, ROWS) <= MAX_GRID_YZ,
            f"latent attention: {entries} entries or {heads} heads past the grid")
    if entries == 0:
        return
    partial_out = partials
    partial_lse = DeviceTensor(partials.ptr + 4 * entries * heads * splits * rank, (entries * heads * splits,),
                               "float32")
    shared = shared_bytes(rank, rope)
    kernel = lib.get_with_shared(kernel_name(rank, rope, selected is not None), MODULE, shared)
    launch_kernel(stream, kernel, (splits, ceil_div(heads, ROWS), entries), THREADS, out, np.int64(out.stride), q,
                  np.int64(q.stride), cache, rows, contexts, tables, NULL if table_rows is None else table_rows,
                  tables.shape[1], NULL, partial_out, partial_lse, heads, block_size.bit_length() - 1,
                  np.float32(scale * LOG2_E), partition, *_selection_args(selected, selected_counts, sinks),
                  shmem=shared)
    if splits > 1:      # a list is split as a context of its length: its counts stand for the contexts
        launch_kernel(stream, lib.get("paged_decode_reduce", "decode_attention"), (heads, entries), rank, out,
                      np.int64(out.stride), rows, contexts if selected is None else selected_counts, partial_out,
                      partial_lse, NULL if sinks is None else sinks, -1, partition, splits)


def prefill(lib, stream, out: DeviceTensor, q: DeviceTensor, cache: DeviceTensor, starts: DeviceTensor,
            lens: DeviceTensor, contexts: DeviceTensor, tables: DeviceTensor, heads: int, block_size: int,
            scale: float, segments: int, max_query: int, max_context: int, selected: DeviceTensor | None = None,
            selected_counts: DeviceTensor | None = None, sinks: DeviceTensor | None = None) -> None:
    """decode()'s attention for every token of `segments` prefill segments (segment s: rows starts[s] .. + lens[s]
    of q and out, the last tokens of its contexts[s], block table row s), each token over its context up to itself,
    the whole context in one CTA (max_context: the longest any segment may have).

    selected [T, width] int32 with selected_counts [T] int32, indexed by the token's row of q and out: that token
    attends the positions selected[row, :selected_counts[row]] (ascending, none past its own) instead, max_context
    then being the longest list (at most width). sinks [heads] float32: as decode()'s."""
    rank, rope = _shape(out, q, cache, heads)
    require(starts.shape[0] >= segments and lens.shape[0] >= segments and contexts.shape[0] >= segments
            and tables.shape[0] >= segments, f"latent attention: {segments} segments' metadata")
    require(block_size & (block_size - 1) == 0, f"latent attention: block size {block_size} must be a power of two")
    require(segments <= MAX_GRID_YZ and ceil_div(heads, ROWS) <= MAX_GRID_YZ,
            f"latent attention: {segments} prefill segments or {heads} heads past the grid")
    _check_selection(selected, selected_counts, sinks, out.shape[0], heads, max_context)
    if segments == 0 or max_query == 0:
        return
    shared = shared_bytes(rank, rope)
    kernel = lib.get_with_shared(kernel_name(rank, rope, selected is not None), MODULE, shared)
    partition = ceil_div(max(max_context, 1), TILE) * TILE          # one split: no partials
    launch_kernel(stream, kernel, (max_query, ceil_div(heads, ROWS), segments), THREADS, out,
                  np.int64(out.stride), q, np.int64(q.stride), cache, starts, contexts, tables, NULL, tables.shape[1],
                  lens, NULL, NULL, heads, block_size.bit_length() - 1, np.float32(scale * LOG2_E), partition,
                  *_selection_args(selected, selected_counts, sinks), shmem=shared)


def _check_selection(selected: DeviceTensor | None, counts: DeviceTensor | None, sinks: DeviceTensor | None,
                     queries: int, heads: int, max_context: int) -> None:
    """selected [queries, width] int32 and counts [queries] int32 (both or neither; max_context at most width),
    sinks [heads] float32."""
    require((selected is None) == (counts is None), "latent attention: selected and selected_counts go together")
    if selected is not None:
        require(selected.dtype == "int32" and len(selected.shape) == 2 and selected.shape[0] == queries
                and selected.ptr % 4 == 0, f"latent attention: selected must be [{queries}, width] int32")
        require(counts.dtype == "int32" and counts.shape == (queries,) and counts.ptr % 4 == 0,
                f"latent attention: selected_counts must be [{queries}] int32")
        require(max_context <= selected.shape[1],
                f"latent attention: max_context {max_context} (the longest list) past the selection's "
                f"{selected.shape[1]} columns")
    if sinks is not None:
        require(sinks.dtype == "float32" and sinks.shape == (heads,) and sinks.ptr % 4 == 0,
                f"latent attention: sinks must be [{heads}] float32")


def _selection_args(selected: DeviceTensor | None, counts: DeviceTensor | None, sinks: DeviceTensor | None) -> tuple:
    """The kernels' last four arguments: selected, selected_counts, selected_stride, sinks (null pointers: none)."""
    return (NULL if selected is None else selected, NULL if counts is None else counts,
            np.int64(0 if selected is None else selected.stride), NULL if sinks is None else sinks)


def _shape(out: DeviceTensor, q: DeviceTensor, cache: DeviceTensor, heads: int) -> tuple[int, int]:
    """(rank, rope) of an attention launch, its operands checked."""
    width = cache.shape[1]
    rank = out.shape[1] // heads
    rope = width - rank
    require(supports(rank, rope), f"latent attention: rank {rank} with rope {rope} is not built (only {SHAPES})")
    require(q.shape[1] >= heads * width and q.dtype == "bfloat16" and q.ptr % 16 == 0 and q.stride % 8 == 0,
            f"latent attention: q must be 16-byte aligned bf16 rows of {heads} x {width}")
    require(out.dtype == "bfloat16" and out.stride % 2 == 0, "latent attention: out must be bf16 (even row stride)")
    require(cache.dtype == "bfloat16" and cache.is_contiguous, "latent attention: cache must be contiguous bf16")
    return rank, rope
