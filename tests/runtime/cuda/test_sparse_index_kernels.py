"""sparse_index.cu against torch: the indexer's rotary parts and key cache rows (its rotary dims first and last),
its per-head weights, each query's scores over a paged key cache (every built head size, heads that fill no, one
or several 16-head tiles, contexts crossing blocks and chunks, a padded max_context, a prompt's tokens over one
block table), and the top-k of rows of scores against a stable sort (ties, contexts below, at and above k, rows
held in shared memory, rows whose candidates are, and rows read from global memory at every pass)."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.kernels import sparse_index  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
d = DeviceTensor.from_torch


def paged_cache(contexts: list[int], head_dim: int, block_size: int, seed: int):
    """An index key cache of random rows, each sequence's tokens in blocks scattered over it: (cache [slots,
    head_dim], tables [S, max_blocks] int32)."""
    generator = torch.Generator().manual_seed(seed)
    per_sequence = [-(-c // block_size) for c in contexts]
    num_blocks = sum(per_sequence) + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(contexts), max(max(per_sequence), 1), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_sequence):
        tables[i, :n] = order[taken:taken + n]
        taken += n
    return torch.randn(num_blocks * block_size, head_dim, generator=generator).bfloat16(), tables


def rope_tables(rope_dim: int, positions: int = 4096):
    """cos, sin [positions, rope_dim / 2] float32."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def reference_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, rope_dim] rotate-half at cos, sin [T, rope_dim / 2] -> float64."""
    x1, x2 = x.double().chunk(2, dim=-1)
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("heads, head_dim, rope_dim", [(64, 128, 64), (4, 32, 16), (20, 64, 32), (8, 32, 32)])
@pytest.mark.parametrize("rope_first", [True, False])
def test_rope_and_write_matches_torch(kernel_library, stream, heads, head_dim, rope_dim, rope_first):
    tokens, slots_in_cache = 7, 24
    generator = torch.Generator().manual_seed(heads + rope_dim)
    q = torch.randn(tokens, heads * head_dim, generator=generator).bfloat16()
    k = torch.randn(tokens, head_dim, generator=generator).bfloat16()
    cos, sin = rope_tables(rope_dim)
    positions = torch.tensor([0, 5, 4095, 17, 1000, 3, 2], dtype=torch.int32)
    slots = torch.tensor([3, -1, 0, 11, 7, 20, -1], dtype=torch.int32)      # -1: a padding token, written nowhere
    dev = {name: t.to(DEVICE) for name, t in dict(q=q, k=k, cos=cos, sin=sin, positions=positions,
                                                   slots=slots).items()}
    cache = torch.full((slots_in_cache, head_dim), 7.0, dtype=torch.bfloat16, device=DEVICE)
    torch.cuda.synchronize()
    sparse_index.rope_and_write(kernel_library, stream, d(dev["q"]), d(dev["k"]), d(dev["cos"]), d(dev["sin"]),
                                d(dev["positions"]), d(dev["slots"]), d(cache), heads, head_dim, rope_dim, rope_first)
    stream.sync()

    rotary = slice(0, rope_dim) if rope_first else slice(head_dim - rope_dim, head_dim)
    plain = slice(rope_dim, head_dim) if rope_first else slice(0, head_dim - rope_dim)
    at = positions.long()
    got_q, q = dev["q"].cpu().view(tokens, heads, head_dim), q.view(tokens, heads, head_dim)
    assert relative_error(got_q[..., rotary], reference_rotate(q[..., rotary], cos[at], sin[at])) < \
        TOLERANCE[torch.bfloat16]
    assert torch.equal(got_q[..., plain], q[..., plain])
    assert torch.equal(dev["k"].cpu(), k)
    written = slots >= 0
    rows = cache.cpu()[slots[written].long()]
    want_k = reference_rotate(k[written][:, None, rotary], cos[at[written]], sin[at[written]])[:, 0]
    assert relative_error(rows[:, rotary], want_k) < TOLERANCE[torch.bfloat16]
    assert torch.equal(rows[:, plain], k[written][:, plain])
    others = torch.ones(slots_in_cache, dtype=torch.bool)
    others[slots[written].long()] = False
    assert (cache.cpu()[others] == 7.0).all()


@pytest.mark.parametrize("tokens, heads, hidden", [(1, 64, 7168), (37, 64, 1024), (9, 20, 256), (5, 4, 64)])
def test_weights_match_torch(kernel_library, stream, tokens, heads, hidden):
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()
    weights_proj = torch.randn(heads, hidden, generator=generator) * 0.02
    scale = (heads * 128) ** -0.5
    out = torch.full((tokens, heads), float("nan"), device=DEVICE)
    dx, dw = x.to(DEVICE), weights_proj.to(DEVICE)
    torch.cuda.synchronize()
    sparse_index.weights(kernel_library, stream, d(out), d(dx), d(dw), scale)
    stream.sync()
    want = x.double() @ weights_proj.double().T * scale
    assert relative_error(out, want) < TOLERANCE[torch.float32]


def reference_scores(q, weights, cache, tables, rows, contexts, table_rows, heads, block_size, max_context):
    """[R, max_context] float64 on the device: sum_h weights[h] relu(q[h] . k_j) for j < contexts[r], else -inf."""
    out = torch.full((len(contexts), max_context), float("-inf"), dtype=torch.float64, device=DEVICE)
    cache = cache.double()
    for r, context in enumerate(contexts):
        if context == 0:
            continue
        table = tables[table_rows[r]].long()
        slots = (table[:, None] * block_size + torch.arange(block_size, device=DEVICE)).reshape(-1)[:context]
        query = q[rows[r]].view(heads, -1).double()                                    # [heads, head_dim]
        out[r, :context] = weights[rows[r]].double() @ torch.relu(query @ cache[slots].T)
    return out


def check_scores(got: torch.Tensor, want: torch.Tensor, max_context: int):
    """got [R, stride]: want's -inf where it has them, its values elsewhere, columns past max_context untouched."""
    scored = got[:, :max_context]
    assert torch.equal(torch.isneginf(scored), torch.isneginf(want))
    finite = ~torch.isneginf(want)
    if finite.any():
        assert relative_error(scored[finite], want[finite]) < TOLERANCE[torch.float32]
    assert (got[:, max_context:] == 123.0).all()


@pytest.mark.parametrize("head_dim", sparse_index.HEAD_DIMS)
@pytest.mark.parametrize("heads, contexts, block_size", [
    (64, [1, 200, 1300], 64),           # DeepSeek-V3.2's 64 heads; a context in its first block, several tiles
    (4, [17, 129, 16], 16),             # fewer heads than a tile; contexts just past a block, a tile, exactly a block
    (20, [1000, 0, 300], 32),           # a second, partial tile of heads; a context of no tokens (all -inf)
    (128, [2500, 64], 1),               # 128 heads; blocks of one token
    (64, [4096 - 37 * i for i in range(64)], 64),     # enough entries for chunks of several tiles
])
def test_scores_match_torch(kernel_library, stream, head_dim, heads, contexts, block_size):
    max_context = max(contexts) + 37            # padded: -inf past each context up to it
    stride = max_context + 11                   # columns past max_context stay as they were
    cache, tables = paged_cache(contexts, head_dim, block_size, seed=heads + len(contexts))
    entries, tokens = len(contexts), len(contexts) + 2
    generator = torch.Generator().manual_seed(head_dim)
    q = torch.randn(tokens, heads * head_dim, generator=generator).bfloat16().to(DEVICE)
    weights = torch.randn(tokens, heads, generator=generator).to(DEVICE)
    rows = torch.randperm(tokens, generator=generator)[:entries].int().to(DEVICE)
    dev_cache, dev_tables = cache.to(DEVICE), tables.to(DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = torch.full((entries, stride), 123.0, device=DEVICE)
    assert sparse_index.chunk_tiles(entries, max_context) > 1 or len(contexts) < 64
    torch.cuda.synchronize()
    sparse_index.scores(kernel_library, stream, d(out), d(q), d(weights), d(dev_cache), d(rows), d(context_lens),
                        d(dev_tables), None, block_size, max_context)
    stream.sync()
    want = reference_scores(q, weights, dev_cache, dev_tables, rows.tolist(), contexts, list(range(entries)), heads,
                            block_size, max_context)
    check_scores(out, want, max_context)


def test_a_prompts_tokens_score_their_causal_contexts_over_one_table(kernel_library, stream):
    """A prefill segment's tokens, each an entry over its context up to itself, all through block table row 1."""
    heads, head_dim, block_size, n, context = 16, 64, 16, 40, 300
    cache, tables = paged_cache([50, context], head_dim, block_size, seed=5)
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(n, heads * head_dim, generator=generator).bfloat16().to(DEVICE)
    weights = torch.randn(n, heads, generator=generator).to(DEVICE)
    contexts = [context - n + i + 1 for i in range(n)]
    rows = torch.arange(n, dtype=torch.int32, device=DEVICE)
    table_rows = torch.ones(n, dtype=torch.int32, device=DEVICE)
    dev_cache, dev_tables = cache.to(DEVICE), tables.to(DEVICE)
    out = torch.full((n, context), 123.0, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    sparse_index.scores(kernel_library, stream, d(out), d(q), d(weights), d(dev_cache), d(rows), d(context_lens),
                        d(dev_tables), d(table_rows), block_size, context)
    stream.sync()
    want = reference_scores(q, weights, dev_cache, dev_tables, list(range(n)), contexts, [1] * n, heads, block_size,
                            context)
    check_scores(out, want, context)


def row_of(kind: str, columns: int, generator: torch.Generator) -> torch.Tensor:
    """Scores of one kind: normal (few ties), integers (ties everywhere), equal (one value), uniform in [1, 2)
    (keys sharing their first bits), sparse (-inf but every 500th)."""
    if kind == "normal":
        return torch.randn(columns, generator=generator)
    if kind == "integers":
        return torch.randint(0, 4, (columns,), generator=generator).float()
    if kind == "equal":
        return torch.full((columns,), 0.5)
    if kind == "uniform":
        return 1 + torch.rand(columns, generator=generator)
    row = torch.full((columns,), float("-inf"))
    row[::500] = torch.randn(len(row[::500]), generator=generator)
    return row


def reference_top_k(scores: torch.Tensor, contexts: list[int], k: int):
    """(indices [R, k], counts [R]): each row's min(k, n) highest of its first n, ties to the lower column (a
    stable sort), in ascending column order, then -1."""
    indices = torch.full((len(contexts), k), -1, dtype=torch.int32)
    counts = torch.zeros(len(contexts), dtype=torch.int32)
    for r, context in enumerate(contexts):
        n = min(context, scores.shape[1])
        chosen = torch.sort(scores[r, :n], descending=True, stable=True).indices[:k].sort().values
        indices[r, :len(chosen)] = chosen.int()
        counts[r] = len(chosen)
    return indices, counts


@pytest.mark.parametrize("k", [64, 2048])
def test_top_k_matches_a_stable_sort(kernel_library, stream, k):
    staged = sparse_index.top_k_capacity(kernel_library.arch, 1 << 30)
    rows = [(0, "normal"), (1, "normal"), (k - 1, "integers"), (k, "equal"), (k + 1, "integers"), (k + 1, "equal"),
            (3 * k, "normal"), (5000, "sparse"), (5000, "equal"), (staged, "integers"),          # held in shared
            (40000, "uniform"), (staged + 1, "normal"), (160000, "normal"),                      # candidates held
            (staged + 1, "equal"), (160000, "integers"), (160000, "equal"), (160000, "uniform"),  # read every pass
            (200000, "normal")]                                                                 # past the columns
    columns = 160005
    generator = torch.Generator().manual_seed(k)
    scores = torch.stack([row_of(kind, columns, generator) for _, kind in rows])
    contexts = [context for context, _ in rows]
    dev_scores = scores.to(DEVICE)
    dev_contexts = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    indices = torch.full((len(rows), k), 12345, dtype=torch.int32, device=DEVICE)
    counts = torch.full((len(rows),), 12345, dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    sparse_index.top_k(kernel_library, stream, d(indices), d(counts), d(dev_scores), d(dev_contexts), k)
    stream.sync()
    want_indices, want_counts = reference_top_k(scores, contexts, k)
    assert torch.equal(counts.cpu(), want_counts)
    for r, (context, kind) in enumerate(rows):
        assert torch.equal(indices[r].cpu(), want_indices[r]), f"row {r}: context {context}, {kind}"
