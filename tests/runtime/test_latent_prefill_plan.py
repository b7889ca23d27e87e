"""The up-projected latent prefill's plan, without a GPU: every key of every segment lands in exactly one piece, in
order, at the cache slot its block table gives; no piece holds more than its rows; the plan's image places each
piece's ranges and slots where the device views read them; and the launch matches the kernel's parameters."""

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import FakeLibrary, bf16, f32, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda import latent_prefill  # noqa: E402
from metrale.runtime.backend.cuda.kernels import attention  # noqa: E402

BLOCK = 16


def tables_for(contexts, seed=0):
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(sum(-(-c // BLOCK) for c in contexts) + 5)
    tables, taken = [], 0
    for c in contexts:
        n = -(-c // BLOCK)
        tables.append(blocks[taken:taken + n].tolist())
        taken += n
    return tables


@pytest.mark.parametrize("contexts, rows", [([45], 64), ([150, 70, 1], 64), ([300], 128), ([64, 64], 64),
                                            ([10, 20, 30], 4096)])
def test_pieces_cover_every_key_once(contexts, rows):
    tables = tables_for(contexts)
    pieces = latent_prefill.plan_pieces(contexts, tables, BLOCK, rows)
    assert len(pieces) == -(-sum(contexts) // rows)
    seen = [[] for _ in contexts]
    for piece in pieces:
        assert 0 < piece.slots.size <= rows
        for s, table in enumerate(tables):
            lo, hi, at = int(piece.key_lo[s]), int(piece.key_hi[s]), int(piece.row_starts[s])
            keys = np.arange(lo, hi)
            assert (piece.slots[at:at + hi - lo] == np.asarray(table)[keys // BLOCK] * BLOCK + keys % BLOCK).all()
            seen[s] += keys.tolist()
    assert seen == [list(range(c)) for c in contexts]


def test_image_places_ranges_and_slots():
    contexts = [150, 70]
    pieces = latent_prefill.plan_pieces(contexts, tables_for(contexts), BLOCK, 64)
    image, places = latent_prefill.plan_image(pieces)
    for piece, (ranges_at, slots_at, rows) in zip(pieces, places):
        assert ranges_at % latent_prefill.ALIGN == 0 and slots_at % latent_prefill.ALIGN == 0
        assert (image[ranges_at:ranges_at + 6] == np.concatenate([piece.key_lo, piece.key_hi, piece.row_starts])).all()
        assert rows == piece.slots.size and (image[slots_at:slots_at + rows] == piece.slots).all()


def test_piece_rows_are_whole_tiles_within_the_budget():
    rows = latent_prefill.piece_rows(576, 16, 128, 128)
    assert rows % attention.KV_TILE == 0 and rows * 2 * (576 + 16 * 256) <= latent_prefill.PIECE_BYTES
    assert latent_prefill.piece_rows(576, 128, 128, 128) < rows


def test_launch_matches_the_kernel(monkeypatch):
    recorded = record_launches(monkeypatch, attention)
    heads, tokens = 16, 70
    q = bf16(tokens, heads * 192)
    query = bf16(tokens, heads * 576)
    piece = attention.LatentPiece(i32(2), i32(2), i32(2))
    attention.latent_prefill_attention(FakeLibrary(), None, bf16(tokens, heads * 128), (f32(tokens, heads * 128),
                                       f32(tokens, heads)), q.columns(0, 128), 192, query.columns(512, 576), 576,
                                       bf16(100, heads * 128), bf16(100, heads * 128), bf16(100, 576).columns(512, 576),
                                       i32(2), i32(2), i32(2), piece, heads, 0.1, 2, 65, first=True, last=False)
    (module, name), grid, block, args, shmem = recorded[0]
    assert name == "latent_prefill_attention_n128_r64_v128"
    assert [type(a) for a in args] == parameter_types(module, name, "LATENT_PREFILL")
    assert grid == (2, heads, 2) and block == 128 and shmem == attention.latent_prefill_shared_bytes(128, 64, 128)
