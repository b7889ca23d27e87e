"""sparse_index.cu's launchers without a GPU: their arguments match each kernel's parameter list, the grids follow
the tokens, heads, entries and context chunks, the shared memory is what the kernels lay out, and bad shapes are
refused before anything is launched."""

import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import FakeLibrary, bf16, f32, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda.kernels import sparse_index  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402


def rope(lib, tokens=5, heads=64, head_dim=128, rope_dim=64, q=None, cos=None):
    sparse_index.rope_and_write(lib, None, q or bf16(tokens, heads * head_dim), bf16(tokens, head_dim),
                                cos or f32(4096, rope_dim // 2), f32(4096, rope_dim // 2), i32(tokens), i32(tokens),
                                bf16(1024, head_dim), heads, head_dim, rope_dim, True)


def weights(lib, tokens=37, heads=64, hidden=7168, x=None, out=None):
    sparse_index.weights(lib, None, out or f32(tokens, heads), x or bf16(tokens, hidden), f32(heads, hidden), 0.01)


def scores(lib, entries=3, heads=64, head_dim=128, max_context=1000, q=None, cache=None, out=None, block_size=64,
           table_rows=True):
    sparse_index.scores(lib, None, out or f32(entries, max_context), q or bf16(10, heads * head_dim),
                        f32(10, heads), cache or bf16(4096, head_dim), i32(entries), i32(entries), i32(4, 70),
                        i32(entries) if table_rows else None, block_size, max_context)


def top_k(lib, entries=4, columns=1000, k=64, indices=None):
    sparse_index.top_k(lib, None, indices or i32(entries, k), i32(entries), f32(entries, columns), i32(entries), k)


def only_launch(recorded, macro=None):
    assert len(recorded) == 1
    (module, name), grid, block, args, shmem = recorded[0]
    assert [type(a) for a in args] == parameter_types(module, name, macro)
    return name, grid, block, args, shmem


def test_rope_and_write_is_a_token_a_cta(monkeypatch):
    recorded = record_launches(monkeypatch, sparse_index)
    rope(FakeLibrary())
    name, grid, block, args, _ = only_launch(recorded)
    assert name == "rope_and_write_index" and grid == 5 and block == sparse_index.ROPE_THREADS
    assert args[-4:] == [64, 128, 64, 1]


@pytest.mark.parametrize("tokens, heads, grid", [(1, 64, (1, 64)), (37, 64, (5, 64)), (9, 20, (2, 20))])
def test_weights_grid_follows_tokens_and_heads(monkeypatch, tokens, heads, grid):
    recorded = record_launches(monkeypatch, sparse_index)
    weights(FakeLibrary(), tokens, heads)
    name, launched, block, args, _ = only_launch(recorded)
    assert name == "index_weights" and launched == grid and block == 256
    assert args[-4:-1] == [tokens, heads, 7168]


@pytest.mark.parametrize("head_dim", sparse_index.HEAD_DIMS)
@pytest.mark.parametrize("entries, heads, max_context", [(3, 64, 1000), (1, 128, 163840), (64, 20, 163840),
                                                         (4096, 16, 8192)])
def test_scores_grid_covers_every_context_chunk(monkeypatch, head_dim, entries, heads, max_context):
    recorded = record_launches(monkeypatch, sparse_index)
    scores(FakeLibrary(), entries, heads, head_dim, max_context)
    name, grid, block, args, shmem = only_launch(recorded, "INDEX_SCORES_ENTRY")
    chunk = args[-1]
    assert name == f"index_scores_d{head_dim}" and block == 128
    assert chunk % 128 == 0 and 128 <= chunk <= 1024 and grid == (entries, -(-max_context // chunk))
    assert args[-5:-1] == [70, heads, 6, max_context]
    padded_heads = -(-heads // 16) * 16
    assert shmem == sparse_index.scores_shared_bytes(head_dim, heads) == (256 + padded_heads) * (head_dim + 8) * 2


def test_scores_split_a_lone_long_context_and_take_whole_chunks_for_many(monkeypatch):
    assert sparse_index.chunk_tiles(1, 163840) == 1 and sparse_index.chunk_tiles(64, 163840) == 8
    assert sparse_index.chunk_tiles(1, 100) == 1 and sparse_index.chunk_tiles(8192, 300) == 3


def test_scores_without_table_rows_pass_null(monkeypatch):
    recorded = record_launches(monkeypatch, sparse_index)
    scores(FakeLibrary(), table_rows=False)
    assert only_launch(recorded, "INDEX_SCORES_ENTRY")[3][10] == 0


@pytest.mark.parametrize("columns, capacity", [(1000, 1000), (163840, sparse_index.STAGED["sm_90a"])])
def test_top_k_is_a_row_a_cta(monkeypatch, columns, capacity):
    recorded = record_launches(monkeypatch, sparse_index)
    top_k(FakeLibrary(), columns=columns)
    name, grid, block, args, shmem = only_launch(recorded)
    assert name == "index_top_k" and grid == 4 and block == sparse_index.TOP_K_THREADS
    assert args[-3:] == [columns, 64, capacity] and shmem == 4 * capacity


def test_scratch_is_the_weights_and_the_scores():
    scratch = sparse_index.scratch_elements(tokens=10, entries=3, heads=64, max_context=1000)
    assert scratch == (640, 3000) and scratch.weights == 640 and scratch.scores == 3000


@pytest.mark.parametrize("call", [
    lambda lib: rope(lib, rope_dim=66, cos=f32(4096, 33)),                     # rope_dim not a multiple of 4
    lambda lib: rope(lib, q=bf16(5, 64 * 64)),                                  # q not heads x head_dim
    lambda lib: rope(lib, cos=f32(4096, 16)),                                   # cos not [P, rope_dim / 2]
    lambda lib: weights(lib, hidden=7170),                                      # hidden not a multiple of 4
    lambda lib: weights(lib, out=f32(37, 32)),                                  # out not [T, heads]
    lambda lib: weights(lib, x=bf16(37, 7168, offset=2)),                       # x not 8-byte aligned
    lambda lib: scores(lib, head_dim=96, q=bf16(10, 64 * 96)),                  # a head_dim not built
    lambda lib: scores(lib, heads=129, q=bf16(10, 129 * 128)),                  # too many heads
    lambda lib: scores(lib, q=bf16(10, 64 * 128, offset=8)),                    # q not 16-byte aligned
    lambda lib: scores(lib, out=f32(3, 999)),                                   # out narrower than max_context
    lambda lib: scores(lib, cache=bf16(4096, 64)),                              # cache rows not head_dim
    lambda lib: scores(lib, block_size=48),                                     # not a power of two
    lambda lib: top_k(lib, indices=i32(4, 32)),                                 # indices not [R, k]
    lambda lib: top_k(lib, k=0, indices=i32(4, 0)),                             # k not positive
])
def test_bad_shapes_are_refused_before_a_launch(monkeypatch, call):
    recorded = record_launches(monkeypatch, sparse_index)
    with pytest.raises(InvalidArgument):
        call(FakeLibrary())
    assert not recorded
