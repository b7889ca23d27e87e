"""The decode attention launcher's multi-head variants without a GPU: the kernel each picks, its arguments against
the kernel's parameter list, and the variants it refuses before any launch."""

import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import BASE, FakeLibrary, bf16, f32, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda.kernels import attention  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

HEADS, KV_HEADS, BLOCK_SIZE, NUM_BLOCKS, P = 4, 2, 16, 8, 64
DECODE_HEAD_DIM = 64                              # one the decode kernels are built for


def decode_with_new_tokens(lib, heads=HEADS, kv_heads=HEADS, k_offset=0, rotary=True):
    """A multi-head decode launch of 3 sequences whose new tokens' k and v are column slices of a qkv buffer;
    rotary=False: no cos and sin tables (nothing rotated)."""
    d = DECODE_HEAD_DIM
    width, stride = heads * d, (heads + 2 * kv_heads) * d
    tables = (f32(P, d // 2), f32(P, d // 2)) if rotary else (None, None)
    new = attention.NewTokens(bf16(5, kv_heads * d, offset=2 * width + k_offset, row_stride=stride),
                              bf16(5, kv_heads * d, offset=2 * (width + kv_heads * d), row_stride=stride),
                              *tables, i32(5), i32(5))
    attention.paged_decode_attention(lib, None, bf16(5, width), bf16(5, width, row_stride=stride),
                                     bf16(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d), i32(3), i32(3), i32(3, 4), None,
                                     heads, kv_heads, d, d ** -0.5, -1, 64, partition=64, new_tokens=new)


@pytest.mark.parametrize("rotary", [True, False])
def test_decode_attention_with_new_tokens_launch(monkeypatch, rotary):
    recorded = record_launches(monkeypatch, attention)
    decode_with_new_tokens(FakeLibrary(), rotary=rotary)
    [((module, name), grid, block, args, _)] = recorded
    assert module == "decode_attention_mha"
    assert (name, grid, block) == (f"paged_decode_attention_mha_new_hd{DECODE_HEAD_DIM}", (1, 1, 3), 128)
    assert [type(a) for a in args] == parameter_types(module, name, macro="DECODE_NEW_ENTRY")
    assert args[-8] == BASE + 2 * HEADS * DECODE_HEAD_DIM and args[-7] == 3 * HEADS * DECODE_HEAD_DIM
    assert (args[-4] != 0 and args[-3] != 0) == rotary        # no tables: null pointers, the kernel rotates nothing


def decode_with_query_partials(lib, splits=4, heads=HEADS, kv_heads=HEADS, rows=5, bias=True):
    """A multi-head decode launch of 3 sequences whose queries are a linear's split-K partials."""
    d = DECODE_HEAD_DIM
    width = heads * d
    partials = attention.QueryPartials(splits, bf16(width, offset=1 << 20) if bias else None)
    attention.paged_decode_attention(lib, None, bf16(5, width), f32(rows * splits, width),
                                     bf16(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d), i32(3), i32(3), i32(3, 4), None,
                                     heads, kv_heads, d, d ** -0.5, -1, 64, partition=64, q_partials=partials)


@pytest.mark.parametrize("bias", [True, False])
def test_decode_attention_with_query_partials_launch(monkeypatch, bias):
    recorded = record_launches(monkeypatch, attention)
    decode_with_query_partials(FakeLibrary(), bias=bias)
    [((module, name), grid, block, args, _)] = recorded
    assert module == "decode_attention_mha"
    assert (name, grid, block) == (f"paged_decode_attention_mha_partial_q_hd{DECODE_HEAD_DIM}", (1, 1, 3), 128)
    assert [type(a) for a in args] == parameter_types(module, name, macro="DECODE_PARTIAL_Q_ENTRY")
    width = HEADS * DECODE_HEAD_DIM
    # q's row stride (the partials' width), then the partials, one slice's elements, the count, the bias (or null)
    assert args[3] == width and args[-4:] == [BASE, 5 * width, 4, BASE + (1 << 20) if bias else 0]


@pytest.mark.parametrize("case, call", [
    ("new tokens of grouped heads", lambda lib: decode_with_new_tokens(lib, kv_heads=KV_HEADS)),
    ("misaligned new k", lambda lib: decode_with_new_tokens(lib, k_offset=8)),
    ("query partials of grouped heads", lambda lib: decode_with_query_partials(lib, kv_heads=KV_HEADS)),
    ("query partials of another batch", lambda lib: decode_with_query_partials(lib, rows=4)),
    ("too many query partials", lambda lib: decode_with_query_partials(lib, splits=attention.MAX_Q_PARTIALS + 1))])
def test_decode_attention_refuses_variants_it_cannot_take(monkeypatch, case, call):
    recorded = record_launches(monkeypatch, attention)
    with pytest.raises(InvalidArgument, match="paged_decode_attention"):
        call(FakeLibrary())
    assert recorded == []
