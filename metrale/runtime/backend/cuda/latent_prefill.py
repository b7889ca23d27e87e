"""Multi-head latent attention's prefill on the GPU, up-projected as an ordinary attention with key dims nope + rope
and value dims v (DeepSeek: 192 and 128): each prefill segment's context (its earlier chunks' cached latents and
the chunk's own) gathered from the paged latent cache in pieces of at most piece_rows keys, each piece's latents
up-projected to every head's keys and values (two GEMMs), the segments' queries attending over the pieces one
after another (prefill_attention.cu's latent_prefill_attention), the pieces merged by log-sum-exp. Decode rows stay
in the latent space (latent_attention.cu)."""

from dataclasses import dataclass

import numpy as np

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.kernels.attention import KV_TILE, LATENT_PREFILL_DIMS, LatentPiece
from metrale.runtime.backend.cuda.linears import linear_into
from metrale.runtime.backend.cuda.tensor import DeviceTensor

PIECE_BYTES = 128 << 20     # a stream's gathered latents and their keys and values, for one piece
PLAN_INTS = 1 << 22         # a forward's plan on the device: each piece's segment ranges and its keys' cache slots
ALIGN = 4                   # int32s: each part of the plan starts 16-byte aligned


def supports(nope: int, rope: int, v: int) -> bool:
    return (nope, rope, v) in LATENT_PREFILL_DIMS


def piece_rows(width: int, heads: int, nope: int, v: int) -> int:
    """Keys a piece holds: PIECE_BYTES of gathered latents (width a key) and up-projected keys and values, a
    multiple of the attention's tile."""
    per_row = 2 * (width + heads * (nope + v))
    return max(KV_TILE, min(1 << 15, PIECE_BYTES // per_row) // KV_TILE * KV_TILE)


def buffer_elements(width: int, heads: int, nope: int, v: int, max_batch_tokens: int) -> dict[str, int]:
    """Elements of a stream's buffers for this path: the piece's keys (bf16), the merge of several pieces (fp32:
    each row's output and log-sum-exp a head), the plan (int32)."""
    rows = piece_rows(width, heads, nope, v)
    return {"keys": rows * (width + heads * (nope + v)), "merge": max_batch_tokens * heads * (v + 1),
            "plan": PLAN_INTS}


@dataclass
class Piece:
    """One piece on the host: segment s's keys key_lo[s] .. key_hi[s] at rows row_starts[s] .. (int32 [S] each;
    empty where key_lo == key_hi), and the cache slot of each of its rows."""
    key_lo: np.ndarray
    key_hi: np.ndarray
    row_starts: np.ndarray
    slots: np.ndarray


def plan_pieces(contexts, tables, block_size: int, rows: int) -> list[Piece]:
    """The segments' keys (segment s: its first contexts[s], through block table tables[s]) in order, cut into
    pieces of at most `rows`; a segment may span pieces."""
    segments = len(contexts)
    pieces: list[Piece] = []
    current, used, slots = None, 0, []

    def close():
        nonlocal current, used, slots
        if current is not None and used:
            current.slots = np.concatenate(slots).astype(np.int32)
            pieces.append(current)
        current, used, slots = None, 0, []

    for s, (context, table) in enumerate(zip(contexts, tables)):
        keys = np.arange(context)
        table = np.asarray(table, dtype=np.int64)
        key_slots = table[keys // block_size] * block_size + keys % block_size
        k = 0
        while k < context:
            if current is None:
                current = Piece(*(np.zeros(segments, np.int32) for _ in range(3)), np.zeros(0, np.int32))
            take = min(rows - used, context - k)
            current.key_lo[s], current.key_hi[s], current.row_starts[s] = k, k + take, used
            slots.append(key_slots[k:k + take])
            used, k = used + take, k + take
            if used == rows:
                close()
    close()
    return pieces


def plan_image(pieces: list[Piece]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The plan as one int32 image, and each piece's (offset of its ranges, offset of its slots, rows) in it."""
    parts, places, offset = [], [], 0
    for piece in pieces:
        ranges = np.concatenate([piece.key_lo, piece.key_hi, piece.row_starts])
        slots_at = offset + -(-ranges.size // ALIGN) * ALIGN
        end = slots_at + -(-piece.slots.size // ALIGN) * ALIGN
        image = np.zeros(end - offset, np.int32)
        image[:ranges.size] = ranges
        image[slots_at - offset:slots_at - offset + piece.slots.size] = piece.slots
        parts.append(image)
        places.append((offset, slots_at, piece.slots.size))
        offset = end
    return (np.concatenate(parts) if parts else np.zeros(0, np.int32)), places


class DevicePlan:
    """A forward's pieces on the device (at most `rows` keys each): each piece's LatentPiece, its keys' cache slots
    and their count."""

    def __init__(self, ctx, image: np.ndarray, places, segments: int, rows: int):
        self.rows = rows
        ctx.copy_to_device(DeviceTensor(ctx.latent_plan.ptr, image.shape, "int32"), image)
        base = ctx.latent_plan.ptr
        self.pieces = [(LatentPiece(*(DeviceTensor(base + 4 * (at + i * segments), (segments,), "int32")
                                      for i in range(3))),
                        DeviceTensor(base + 4 * slots_at, (rows,), "int32"), rows)
                       for at, slots_at, rows in places]


def plan_for(ctx, batch, mla, block_size: int) -> DevicePlan | None:
    """The batch's plan, made and uploaded at its first latent layer; None where this path does not apply (a
    prefill graph's padded batch, head dims not built, a plan past its buffer): its prefill rows then attend in
    the latent space."""
    if batch.prefill_spans is None or ctx.latent_keys is None or not supports(mla.nope_dim, mla.rope_dim, mla.v_dim):
        return None
    if batch.latent_plan is None:
        contexts, tables = batch.prefill_spans
        rows = piece_rows(mla.cache_width, mla.num_heads, mla.nope_dim, mla.v_dim)
        image, places = plan_image(plan_pieces(contexts, tables, block_size, rows))
        batch.latent_plan = (DevicePlan(ctx, image, places, len(contexts), rows)
                             if image.size <= ctx.latent_plan.numel else False)
    return batch.latent_plan or None


def attend(lib, gemm, ctx, batch, plan: DevicePlan, out: DeviceTensor, q: DeviceTensor, query: DeviceTensor,
           cache_rows: DeviceTensor, mla, scale: float) -> None:
    """out's prefill rows [T, heads * v] = the up-projected attention of q's rows (each head's nope then rope
    columns; the rotary part rotated in query, the latent-space query, after each head's rank columns) over their
    segments' contexts in cache_rows [slots, rank + rope], piece by piece."""
    heads, nope, rope, v, rank = mla.num_heads, mla.nope_dim, mla.rope_dim, mla.v_dim, mla.kv_lora_rank
    width, rows = rank + rope, plan.rows
    k_up = DeviceTensor(mla.k_up.ptr, (heads * nope, rank), "bfloat16")
    v_up = DeviceTensor(mla.v_up.ptr, (heads * v, rank), "bfloat16")
    base = ctx.latent_keys.ptr
    tokens = q.shape[0]
    merged = (DeviceTensor(ctx.latent_merge.ptr, (tokens, heads * v), "float32"),
              DeviceTensor(ctx.latent_merge.ptr + 4 * tokens * heads * v, (tokens, heads), "float32"))
    count = len(plan.pieces)
    for i, (piece, slots, n) in enumerate(plan.pieces):
        gathered = DeviceTensor(base, (n, width), "bfloat16")
        k_nope = DeviceTensor(base + 2 * rows * width, (n, heads * nope), "bfloat16")
        values = DeviceTensor(base + 2 * rows * (width + heads * nope), (n, heads * v), "bfloat16")
        kernels.embedding.gather_rows(lib, ctx.stream, gathered, cache_rows, slots)
        linear_into(lib, gemm, ctx, k_nope, gathered.columns(0, rank), k_up)
        linear_into(lib, gemm, ctx, values, gathered.columns(0, rank), v_up)
        kernels.attention.latent_prefill_attention(
            lib, ctx.stream, out, merged if count > 1 else None, q.columns(0, nope), nope + rope,
            query.columns(rank, width), width, k_nope, values, gathered.columns(rank, width), batch.prefill_starts,
            batch.prefill_lens, batch.prefill_contexts, piece, heads, scale, batch.num_prefill,
            batch.max_prefill_query, first=i == 0, last=i == count - 1)
