"""latent_attention.cu against torch: attention in the latent space over a paged latent cache (every built rank and
rope width, heads that fill no, one or several 16-head tiles, contexts in one split and in many, merged by
paged_decode_reduce; over lists of selected tokens, with attention sinks), and the rotary parts with the cache rows
rope_and_write_latent writes; and the up-projected prefill attention of prefill_attention.cu, its contexts in one
piece and in several."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda import latent_prefill  # noqa: E402
from metrale.runtime.backend.cuda.kernels import attention, latent_attention  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BLOCK = 16
d = DeviceTensor.from_torch


def paged_cache(contexts: list[int], width: int, seed: int):
    """A cache of random rows, each entry's tokens in blocks scattered over it: (cache [slots, width], tables)."""
    generator = torch.Generator().manual_seed(seed)
    per_entry = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(per_entry) + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(contexts), max(per_entry), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_entry):
        tables[i, :n] = order[taken:taken + n]
        taken += n
    cache = torch.randn(num_blocks * BLOCK, width, generator=generator).bfloat16()
    return cache, tables


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, contexts: list[int], heads: int,
              rank: int, scale: float, positions: list[torch.Tensor] | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Query i over its first contexts[i] tokens, or the tokens at positions[i] of them; sinks [heads]: each head's
    logit in the softmax, its column dropped after (as layer_math's _softmax)."""
    out = []
    for i, context in enumerate(contexts):
        blocks = tables[i, :-(-context // BLOCK)].long()
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:context]
        if positions is not None:
            slots = slots[positions[i].long()]
        rows = cache[slots].double()                                              # [C, width]
        query = q[i].view(heads, -1).double()                                     # [H, width]
        scores = query @ rows.T * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
        probs = torch.softmax(scores, dim=-1)[:, :rows.shape[0]]
        out.append((probs @ rows[:, :rank]).reshape(-1))
    return torch.stack(out)


def selection(contexts: list[int], counts: list[int], seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """counts[i] distinct positions below contexts[i] for each query, ascending: (each list, the lists as rows of an
    int32 [queries, max(counts) + 8] padded with -1, which the kernels never read)."""
    generator = torch.Generator().manual_seed(seed)
    lists = [torch.randperm(c, generator=generator)[:n].sort().values.int() for c, n in zip(contexts, counts)]
    table = torch.full((len(lists), max(counts) + 8), -1, dtype=torch.int32)
    for i, chosen in enumerate(lists):
        table[i, :chosen.numel()] = chosen
    return lists, table


def sink_logits(heads: int, seed: int) -> torch.Tensor:
    """[heads] float32 of the scaled scores' order, and one well above them (head 1: most of its weight on the sink
    where a list is short)."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed))
    sinks[1] = 6.0
    return sinks


@pytest.mark.parametrize("rank, rope", latent_attention.SHAPES)
@pytest.mark.parametrize("heads, contexts, partition", [
    (4, [1, 17, 40], 1024),                 # one split; fewer heads than a tile
    (16, [300, 5, 64, 33], 64),             # several splits, a context ending mid-tile, one exactly a tile
    (20, [129, 1000, 2], 256),              # a second, partial tile of heads; long splits
    (128, [70, 31], 32),                    # DeepSeek-V3's 128 heads; splits of one tile
    (16, [700, 3000, 9], None),             # the launcher's own choice
])
def test_decode_matches_torch(kernel_library, stream, rank, rope, heads, contexts, partition):
    width, scale = rank + rope, 0.3 / (rank ** 0.5)
    cache, tables = paged_cache(contexts, width, seed=heads)
    q = torch.randn(len(contexts), heads * width, generator=torch.Generator().manual_seed(1)).bfloat16()
    entries = len(contexts)
    chosen = partition or latent_attention.partition_for(kernel_library, entries, heads, max(contexts), rank, rope)[0]
    splits = -(-max(contexts) // chosen)
    dev = {name: t.to(DEVICE) for name, t in dict(cache=cache, tables=tables, q=q).items()}
    out = torch.full((entries, heads * rank), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    rows = torch.arange(entries, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    partials = torch.empty(latent_attention.partials_elements(entries, heads, rank, splits), device=DEVICE)
    torch.cuda.synchronize()
    latent_attention.decode(kernel_library, stream, d(out), d(dev["q"]), d(dev["cache"]), d(rows), d(context_lens),
                            d(dev["tables"]), d(rows), d(partials), heads, BLOCK, scale, max(contexts), partition)
    stream.sync()
    want = reference(q, cache, tables, contexts, heads, rank, scale)
    assert relative_error(out.float().cpu(), want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rank, rope", [(32, 16), (512, 64)])
@pytest.mark.parametrize("selected, sinks", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("partition", [1024, 64, None])
def test_decode_over_selected_tokens_with_sinks(kernel_library, stream, rank, rope, selected, sinks, partition):
    """Lists of selected tokens (one of a single token, one ending mid-tile, one a tile exactly, one its whole
    context), or the whole contexts, with or without sinks; in splits of 1024 (every list in one, the longest
    context in two), of 64 merged by paged_decode_reduce, or as the launcher plans them."""
    heads, contexts, counts = 20, [300, 5, 64, 2000, 97], [1, 5, 32, 257, 97]
    width, scale = rank + rope, 0.3 / (rank ** 0.5)
    cache, tables = paged_cache(contexts, width, seed=11)
    q = torch.randn(len(contexts), heads * width, generator=torch.Generator().manual_seed(12)).bfloat16()
    lists, table = selection(contexts, counts, seed=13)
    sink = sink_logits(heads, seed=14) if sinks else None
    entries = len(contexts)
    longest = table.shape[1] - 8 if selected else max(contexts)
    chosen = partition or latent_attention.partition_for(kernel_library, entries, heads, longest, rank, rope,
                                                         selected)[0]
    splits = -(-longest // chosen)
    dev = {name: t.to(DEVICE) for name, t in dict(cache=cache, tables=tables, q=q, table=table).items()}
    out = torch.full((entries, heads * rank), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    rows = torch.arange(entries, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    list_lens = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    sink_dev = None if sink is None else sink.to(DEVICE)
    partials = torch.empty(latent_attention.partials_elements(entries, heads, rank, splits), device=DEVICE)
    optional = dict(sinks=None if sink_dev is None else d(sink_dev))
    if selected:     # the lists as columns of wider rows: the row stride is the tensor's
        optional.update(selected=d(dev["table"][:, :longest]), selected_counts=d(list_lens))
    torch.cuda.synchronize()
    latent_attention.decode(kernel_library, stream, d(out), d(dev["q"]), d(dev["cache"]), d(rows), d(context_lens),
                            d(dev["tables"]), None, d(partials), heads, BLOCK, scale, longest, partition, **optional)
    stream.sync()
    want = reference(q, cache, tables, contexts, heads, rank, scale, lists if selected else None, sink)
    assert relative_error(out.float().cpu(), want) < TOLERANCE[torch.bfloat16]


def test_a_table_row_per_entry_serves_a_prompts_tokens(kernel_library, stream):
    """Entries that share one sequence's block table (a prompt's tokens, each over its causal context)."""
    rank, rope, heads = 32, 16, 4
    contexts = [3, 4, 5, 6]
    cache, tables = paged_cache([6], rank + rope, seed=3)
    q = torch.randn(4, heads * (rank + rope), generator=torch.Generator().manual_seed(2)).bfloat16()
    out = torch.zeros(4, heads * rank, dtype=torch.bfloat16, device=DEVICE)
    rows = torch.arange(4, dtype=torch.int32, device=DEVICE)
    partials = torch.empty(latent_attention.partials_elements(4, heads, rank, 1), device=DEVICE)
    dev_cache, dev_tables, dev_q = cache.to(DEVICE), tables.to(DEVICE), q.to(DEVICE)
    table_rows = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    latent_attention.decode(kernel_library, stream, d(out), d(dev_q), d(dev_cache), d(rows), d(context_lens),
                            d(dev_tables), d(table_rows), d(partials), heads, BLOCK, 0.2, 6, 64)
    stream.sync()
    want = reference(q, cache, tables.expand(4, -1), contexts, heads, rank, 0.2)
    assert relative_error(out.float().cpu(), want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rank, rope", [(32, 16), (512, 64)])
def test_prefill_tokens_attend_causally(kernel_library, stream, rank, rope):
    """Prefill segments (one starting its sequence, one after cached tokens, one of a single token): each token
    over its context up to itself, the entries past a segment's tokens idle."""
    heads, lens, contexts = 20, [5, 37, 1], [5, 100, 64]
    width, scale = rank + rope, 0.3 / (rank ** 0.5)
    cache, tables = paged_cache(contexts, width, seed=7)
    tokens = sum(lens)
    q = torch.randn(tokens, heads * width, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = torch.full((tokens, heads * rank), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    starts = torch.tensor([0, 5, 42], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (q, cache, starts, torch.tensor(lens, dtype=torch.int32),
                                  torch.tensor(contexts, dtype=torch.int32), tables)]
    torch.cuda.synchronize()
    latent_attention.prefill(kernel_library, stream, d(out), *(d(t) for t in dev), heads, BLOCK, scale, 3, max(lens),
                             max(contexts))
    stream.sync()
    entry_contexts = [c - n + i + 1 for n, c in zip(lens, contexts) for i in range(n)]
    entry_tables = torch.cat([tables[s:s + 1].expand(n, -1) for s, n in enumerate(lens)])
    want = reference(q, cache, entry_tables, entry_contexts, heads, rank, scale)
    assert relative_error(out.float().cpu(), want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rank, rope", [(32, 16), (512, 64)])
@pytest.mark.parametrize("sinks", [False, True])
def test_prefill_tokens_attend_their_selected_tokens(kernel_library, stream, rank, rope, sinks):
    """Prefill segments as above, each token over its own list (the row of q and out it has): up to 40 of the
    tokens up to itself, so the longer lists take two tiles."""
    heads, lens, contexts, topk = 20, [5, 37, 1], [5, 100, 64], 40
    width, scale = rank + rope, 0.3 / (rank ** 0.5)
    cache, tables = paged_cache(contexts, width, seed=15)
    starts = [0, 5, 43]                     # a row between the segments that no token has
    tokens = starts[-1] + lens[-1]
    q = torch.randn(tokens, heads * width, generator=torch.Generator().manual_seed(16)).bfloat16()
    causal = [c - n + i + 1 for n, c in zip(lens, contexts) for i in range(n)]
    token_rows = [start + i for start, n in zip(starts, lens) for i in range(n)]
    lists, table = selection(causal, [min(c, topk) for c in causal], seed=17)
    rows_table = torch.full((tokens, topk), -1, dtype=torch.int32)
    rows_table[token_rows] = table[:, :topk]
    counts = torch.zeros(tokens, dtype=torch.int32)
    counts[token_rows] = torch.tensor([chosen.numel() for chosen in lists], dtype=torch.int32)
    sink = sink_logits(heads, seed=18) if sinks else None
    out = torch.full((tokens, heads * rank), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dev = [t.to(DEVICE) for t in (q, cache, torch.tensor(starts, dtype=torch.int32),
                                  torch.tensor(lens, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32),
                                  tables)]
    dev_table, dev_counts = rows_table.to(DEVICE), counts.to(DEVICE)
    sink_dev = None if sink is None else sink.to(DEVICE)
    torch.cuda.synchronize()
    latent_attention.prefill(kernel_library, stream, d(out), *(d(t) for t in dev), heads, BLOCK, scale, 3, max(lens),
                             topk, selected=d(dev_table), selected_counts=d(dev_counts),
                             sinks=None if sink_dev is None else d(sink_dev))
    stream.sync()
    entry_tables = torch.cat([tables[s:s + 1].expand(n, -1) for s, n in enumerate(lens)])
    want = reference(q[token_rows], cache, entry_tables, causal, heads, rank, scale, lists, sink)
    assert relative_error(out[token_rows].float().cpu(), want) < TOLERANCE[torch.bfloat16]


def test_rope_and_write_latent_matches_torch(kernel_library, stream):
    tokens, heads, nope, rank, rope = 5, 3, 16, 32, 16
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(tokens, heads * (nope + rope), generator=generator).bfloat16()
    compressed = torch.randn(tokens, rank + rope, generator=generator).bfloat16()
    positions = torch.tensor([0, 3, 7, 8, 100], dtype=torch.int32)
    slots = torch.tensor([4, -1, 9, 0, 2], dtype=torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope, 2).float() / rope)
    angles = torch.arange(128).float()[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    q_full = torch.zeros(tokens, heads * (rank + rope), dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(12, rank + rope, dtype=torch.bfloat16, device=DEVICE)
    dq, dc = q.to(DEVICE), compressed.to(DEVICE)
    dev = [t.to(DEVICE) for t in (cos, sin, positions, slots)]
    torch.cuda.synchronize()
    latent_attention.rope_and_write(
        kernel_library, stream, d(q_full).columns(rank, rank + rope), rank + rope,
        d(dq).columns(nope, nope + rope), nope + rope, d(dc).columns(0, rank), d(dc).columns(rank, rank + rope),
        *(d(t) for t in dev), d(cache), heads)
    stream.sync()

    def rotate(x):      # [T, n, rope] rotate-half at the positions, fp32, rounded once
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[positions.long()][:, None], sin[positions.long()][:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).bfloat16()

    want_q = rotate(q.view(tokens, heads, -1)[..., nope:])
    got_q = q_full.cpu().view(tokens, heads, -1)[..., rank:]
    assert torch.equal(got_q, want_q)
    want_rows = torch.cat([compressed[:, :rank], rotate(compressed[:, None, rank:])[:, 0]], dim=-1)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(cache[slot].cpu(), want_rows[t])
    assert not cache[[1, 3, 5]].any()       # rows no token names stay as they were


@pytest.mark.parametrize("dims", attention.LATENT_PREFILL_DIMS)
@pytest.mark.parametrize("piece_rows", [None, 64, 128])
def test_up_projected_prefill_matches_torch(kernel_library, stream, dims, piece_rows):
    """prefill_attention.cu's latent_prefill_attention: two segments (a later chunk over 110 earlier keys, a
    prompt whole) over their contexts in one piece, or in pieces of 64 or 128 keys merged by log-sum-exp."""
    nope, rope, v = dims
    heads, contexts, lens, scale = 3, [150, 70], [40, 70], 0.7 / (nope + rope) ** 0.5
    generator = torch.Generator().manual_seed(nope + (piece_rows or 0))
    tokens = sum(lens)
    q = torch.randn(tokens, heads * (nope + rope), generator=generator).bfloat16()
    keys = [torch.randn(c, heads * nope, generator=generator).bfloat16() for c in contexts]
    values = [torch.randn(c, heads * v, generator=generator).bfloat16() for c in contexts]
    ropes = [torch.randn(c, rope, generator=generator).bfloat16() for c in contexts]
    starts = [0, lens[0]]
    want = torch.empty(tokens, heads * v, dtype=torch.float64)
    for s, (context, n) in enumerate(zip(contexts, lens)):
        query = q[starts[s]:starts[s] + n].double().view(n, heads, nope + rope)
        key = torch.cat([keys[s].double().view(context, heads, nope),
                         ropes[s].double()[:, None, :].expand(context, heads, rope)], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", query, key) * scale
        positions = torch.arange(context - n, context)
        scores.masked_fill_(torch.arange(context)[None, None, :] > positions[None, :, None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values[s].double().view(context, heads, v))
        want[starts[s]:starts[s] + n] = out.reshape(n, -1)

    identity = [list(range(c)) for c in contexts]
    pieces = latent_prefill.plan_pieces(contexts, identity, 1, piece_rows or sum(contexts))
    assert len(pieces) == (1 if piece_rows is None else -(-sum(contexts) // piece_rows))
    out = torch.full((tokens, heads * v), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    acc = torch.empty(tokens, heads * v, device=DEVICE)
    lse = torch.empty(tokens, heads, device=DEVICE)
    meta = {name: torch.tensor(values_, dtype=torch.int32, device=DEVICE)
            for name, values_ in (("starts", starts), ("lens", lens), ("contexts", contexts))}
    kept = []
    for i, piece in enumerate(pieces):
        rows = int(piece.slots.size)
        k_rows = torch.zeros(rows, heads * nope, dtype=torch.bfloat16)
        v_rows = torch.zeros(rows, heads * v, dtype=torch.bfloat16)
        r_rows = torch.zeros(rows, rope, dtype=torch.bfloat16)
        for s in range(len(contexts)):
            lo, hi, at = int(piece.key_lo[s]), int(piece.key_hi[s]), int(piece.row_starts[s])
            k_rows[at:at + hi - lo], v_rows[at:at + hi - lo], r_rows[at:at + hi - lo] = (
                keys[s][lo:hi], values[s][lo:hi], ropes[s][lo:hi])
        device = [t.to(DEVICE) for t in (k_rows, v_rows, r_rows, q)]
        ranges = [torch.from_numpy(a).to(DEVICE) for a in (piece.key_lo, piece.key_hi, piece.row_starts)]
        kept += device + ranges
        k_dev, v_dev, r_dev, q_dev = device
        attention.latent_prefill_attention(
            kernel_library, stream, d(out), (d(acc), d(lse)) if len(pieces) > 1 else None,
            d(q_dev).columns(0, nope), nope + rope, d(q_dev).columns(nope, nope + rope), nope + rope, d(k_dev),
            d(v_dev), d(r_dev), d(meta["starts"]), d(meta["lens"]), d(meta["contexts"]),
            attention.LatentPiece(*(d(t) for t in ranges)), heads, scale, 2, max(lens), first=i == 0,
            last=i == len(pieces) - 1)
    stream.sync()
    assert relative_error(out.float().cpu(), want) < TOLERANCE[torch.bfloat16]
