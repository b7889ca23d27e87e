"""The attention launchers without a GPU: the decode launcher's multi-head variants and the prefill launcher's
choice of kernel (the wgmma kernel on sm_90a for head dims 64 and 128, the mma.sync kernel elsewhere): the kernel
each picks, its arguments against the kernel's parameter list, and the variants they refuse before any launch."""

import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import BASE, FakeLibrary, bf16, f32, fp8_kv, i32, parameter_types, record_launches  # noqa: E402
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


class Ada(FakeLibrary):
    arch = "sm_89"


MAP = BASE + (1 << 30)                            # where a fake cache's tensor map lives


def prefill(lib, head_dim, max_query_len=300, hopper=None, tma=True, cache=bf16):
    """3 segments of at most max_query_len rows, Llama-3-8B's heads; cache: bf16 or fp8_kv."""
    heads, kv_heads, segments, rows = 32, 8, 3, 700
    attention.paged_prefill_attention(
        lib, None, bf16(rows, heads * head_dim), bf16(rows, heads * head_dim),
        cache(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), i32(segments), i32(segments), i32(segments),
        i32(segments, 40), heads, kv_heads, head_dim, head_dim ** -0.5, -1, segments, max_query_len, hopper=hopper,
        tma=tma)


@pytest.fixture(autouse=True)
def fake_tensor_maps(monkeypatch):
    """paged_kv_map encodes with the driver; here every cache's map is at MAP."""
    monkeypatch.setattr(attention, "paged_kv_map", lambda kv_cache: MAP)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_runs_the_wgmma_kernel(monkeypatch, head_dim):
    launches = record_launches(monkeypatch, attention)
    prefill(FakeLibrary(), head_dim)
    [((module, name), grid, block, args, shmem)] = launches
    assert (module, name) == ("prefill_attention_hopper", f"paged_prefill_attention_hopper_hd{head_dim}")
    assert grid == (3, 32, 3) and block == 384      # 128 query rows a CTA
    # Q [128 rows] and 3 stages of K and V [128 keys], 128-byte rows of 64 columns, the 1024-byte alignment's
    # slack, 6 barriers and a tile's key tokens
    assert shmem == 1024 + head_dim * 2 * (128 + 3 * 2 * 128) + 6 * 8 + 128 * 4 <= 227 * 1024
    assert [type(a) for a in args] == parameter_types(module, name, "HOPPER_PREFILL_KERNEL")
    assert args[-1] == MAP                          # the cache's tensor map, last


def test_hopper_without_the_tensor_map(monkeypatch):
    launches = record_launches(monkeypatch, attention)
    prefill(FakeLibrary(), 128, tma=False)
    [(_, _, _, args, _)] = launches
    assert args[-1] == 0                            # a null map: every tile gathered with cp.async


@pytest.mark.parametrize("lib, head_dim, hopper", [(FakeLibrary(), 32, None), (Ada(), 128, None),
                                                   (FakeLibrary(), 128, False)], ids=["hd32", "sm_89", "asked"])
def test_elsewhere_the_mma_sync_kernel(monkeypatch, lib, head_dim, hopper):
    launches = record_launches(monkeypatch, attention)
    prefill(lib, head_dim, hopper=hopper)
    [((module, name), grid, block, args, shmem)] = launches
    assert (module, name) == ("prefill_attention", f"paged_prefill_attention_hd{head_dim}")
    assert grid == (5, 32, 3) and block == 128 and shmem == 0    # 64 query rows a CTA
    assert [type(a) for a in args] == parameter_types(module, name, "PREFILL_KERNEL")


def test_both_kernels_take_the_same_arguments(monkeypatch):
    launches = record_launches(monkeypatch, attention)
    prefill(FakeLibrary(), 128)
    prefill(FakeLibrary(), 128, hopper=False)
    assert launches[0][3][:-1] == launches[1][3][:-1]   # then the tensor map, or the (null) FP8 scales
    assert launches[1][3][-1] == 0


def test_an_fp8_cache_prefills_with_the_mma_sync_kernel_on_hopper_too(monkeypatch):
    """The wgmma kernel loads bf16 tiles through tensor maps; the mma.sync kernel widens e4m3 tiles."""
    launches = record_launches(monkeypatch, attention)
    prefill(FakeLibrary(), 128, cache=fp8_kv)
    [((module, name), grid, block, args, _)] = launches
    assert (module, name, grid, block) == ("prefill_attention", "paged_prefill_attention_fp8_hd128", (5, 32, 3), 128)
    assert [type(a) for a in args] == parameter_types(module, name, "PREFILL_KERNEL")
    assert args[-1] == BASE + (1 << 28)             # the scales
    with pytest.raises(InvalidArgument, match="no Hopper kernel"):
        prefill(FakeLibrary(), 128, hopper=True, cache=fp8_kv)


@pytest.mark.parametrize("heads, kv_heads", [(HEADS, KV_HEADS), (HEADS, HEADS)], ids=["grouped", "multi-head"])
def test_an_fp8_cache_decodes_with_the_grouped_fp8_entry(monkeypatch, heads, kv_heads):
    """Multi-head models too: the multi-head kernels read bf16 caches only."""
    d = DECODE_HEAD_DIM
    launches = record_launches(monkeypatch, attention)
    attention.paged_decode_attention(FakeLibrary(), None, bf16(5, heads * d), bf16(5, heads * d),
                                     fp8_kv(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d), i32(3), i32(3), i32(3, 4), None,
                                     heads, kv_heads, d, d ** -0.5, -1, 64, partition=64)
    [((module, name), grid, block, args, _)] = launches
    assert (module, name, grid, block) == ("decode_attention", f"paged_decode_attention_fp8_hd{d}", (1, kv_heads, 3),
                                           128)
    assert [type(a) for a in args] == parameter_types(module, name, "DECODE_FP8_ENTRY")
    assert args[-1] == BASE + (1 << 28) and args[-6] == heads // kv_heads


def test_an_fp8_cache_takes_no_new_tokens_and_needs_its_scales(monkeypatch):
    record_launches(monkeypatch, attention)
    d = DECODE_HEAD_DIM
    new = attention.NewTokens(bf16(5, HEADS * d), bf16(5, HEADS * d), None, None, i32(5), i32(5))
    with pytest.raises(InvalidArgument, match="an FP8 cache takes neither new tokens nor query partials"):
        attention.paged_decode_attention(FakeLibrary(), None, bf16(5, HEADS * d), bf16(5, HEADS * d),
                                         fp8_kv(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, d), i32(3), i32(3), i32(3, 4),
                                         None, HEADS, HEADS, d, d ** -0.5, -1, 64, partition=64, new_tokens=new)
    bare = attention.DeviceTensor(BASE, (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 128), "float8_e4m3")
    with pytest.raises(InvalidArgument, match="kv_cache must be bfloat16, or an Fp8KvTensor"):
        prefill(FakeLibrary(), 128, cache=lambda *shape: bare)


def test_hopper_asked_where_there_is_none():
    with pytest.raises(InvalidArgument, match="no Hopper kernel for sm_89"):
        prefill(Ada(), 128, hopper=True)
    with pytest.raises(InvalidArgument, match="head_dim 32"):
        prefill(FakeLibrary(), 32, hopper=True)
