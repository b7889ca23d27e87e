"""The CUDA kernel launchers without a GPU: each rejects bad shapes, dtypes and alignment before it asks for a
kernel, and what it does launch matches the kernel's parameter list in its .cu source."""

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import BASE, FakeLibrary, bf16, f32, fp8_kv, i32, parameter_types  # noqa: E402
from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix  # noqa: E402
from metrale.runtime.backend.cuda.kernels import activation, embedding, fp8, norm, rope_kv, skinny_gemm  # noqa: E402
from metrale.runtime.backend.cuda.launch import ceil_div, kernel_arg  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

LAUNCHER_MODULES = (activation, embedding, fp8, norm, rope_kv, skinny_gemm)
# Kernels stamped out by a macro (one declaration for all of them).
MACROS = {"rope_and_write_kv": "ROPE_AND_WRITE_KV", "rope_and_write_kv_fp8": "ROPE_AND_WRITE_KV",
          **{f"skinny_gemm_m{m}_fp8{blocks}": "SKINNY_GEMM_FP8" for m in (8, 16) for blocks in ("", "_blocks")},
          **{f"skinny_gated_m{m}_{form}": "SKINNY_GEMM_GATED" for m in (8, 16) for form in ("bf16", "fp8", "fp8_blocks")}}


@pytest.fixture
def launches(monkeypatch):
    """Replaces launch_kernel in every launcher module; records (kernel, grid, block, args) after checking them."""
    recorded = []

    def record(stream, kernel, grid, block, *args, shmem=0):
        module, name = kernel
        converted = [kernel_arg(a) for a in args]
        assert [type(a) for a in converted] == parameter_types(module, name, MACROS.get(name)), f"{name}: arguments"
        grid = grid if isinstance(grid, tuple) else (grid,)
        assert 0 < grid[0] < 2 ** 31 and all(0 < g <= 65535 for g in grid[1:]), f"{name}: grid {grid}"
        assert isinstance(block, int) and 32 <= block <= 1024 and block % 32 == 0, f"{name}: block {block}"
        recorded.append((name, grid, block, converted))

    for module in LAUNCHER_MODULES:
        monkeypatch.setattr(module, "launch_kernel", record)
    return recorded


T, V, H = 7, 100, 64                              # embedding
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, P = 4, 2, 16, 16, 8, 64
QKV_WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def rope_call(qkv=None, cos=None, sin=None, positions=None, slots=None, kv=None, heads=HEADS, kv_heads=KV_HEADS,
              head_dim=HEAD_DIM):
    half = head_dim // 2
    return lambda lib: rope_kv.rope_and_write_kv(
        lib, None, qkv or bf16(5, (heads + 2 * kv_heads) * head_dim), cos or f32(P, half), sin or f32(P, half),
        positions or i32(5), slots or i32(5), kv or bf16(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim),
        heads, kv_heads, head_dim)


BAD_CALLS = {
    "embedding: float32 table": lambda lib: embedding.embedding(lib, None, bf16(T, H), f32(V, H), i32(T)),
    "embedding: float32 out": lambda lib: embedding.embedding(lib, None, f32(T, H), bf16(V, H), i32(T)),
    "embedding: int64 ids": lambda lib: embedding.embedding(lib, None, bf16(T, H), bf16(V, H),
                                                            DeviceTensor(BASE, (T,), "int64")),
    "embedding: 2-D ids": lambda lib: embedding.embedding(lib, None, bf16(T, H), bf16(V, H), i32(T, 1)),
    "embedding: out rows": lambda lib: embedding.embedding(lib, None, bf16(T + 1, H), bf16(V, H), i32(T)),
    "embedding: out width": lambda lib: embedding.embedding(lib, None, bf16(T, H + 8), bf16(V, H), i32(T)),
    "embedding: 1-D table": lambda lib: embedding.embedding(lib, None, bf16(T, H), bf16(V * H), i32(T)),
    "embedding: misaligned ids": lambda lib: embedding.embedding(lib, None, bf16(T, H), bf16(V, H), i32(T, offset=2)),
    "embedding: odd table pointer": lambda lib: embedding.embedding(lib, None, bf16(T, H), bf16(V, H, offset=1),
                                                                    i32(T)),
    "gather_rows: float16": lambda lib: embedding.gather_rows(lib, None, DeviceTensor(BASE, (3, H), "float16"),
                                                              DeviceTensor(BASE, (T, H), "float16"), i32(3)),
    "gather_rows: dtypes differ": lambda lib: embedding.gather_rows(lib, None, f32(3, H), bf16(T, H), i32(3)),
    "gather_rows: int64 rows": lambda lib: embedding.gather_rows(lib, None, bf16(3, H), bf16(T, H),
                                                                 DeviceTensor(BASE, (3,), "int64")),
    "gather_rows: out rows": lambda lib: embedding.gather_rows(lib, None, bf16(4, H), bf16(T, H), i32(3)),
    "gather_rows: out width": lambda lib: embedding.gather_rows(lib, None, bf16(3, H - 1), bf16(T, H), i32(3)),
    "gather_rows: odd x pointer": lambda lib: embedding.gather_rows(lib, None, bf16(3, H), bf16(T, H, offset=1),
                                                                    i32(3)),
    "gather_rows: misaligned rows": lambda lib: embedding.gather_rows(lib, None, bf16(3, H), bf16(T, H),
                                                                      i32(3, offset=2)),
    "rms_norm: hidden not a multiple of 8": lambda lib: norm.rms_norm(lib, None, bf16(5, 100), bf16(5, 100),
                                                                      bf16(100), 1e-6),
    "rms_norm: hidden too large": lambda lib: norm.rms_norm(lib, None, bf16(5, 40000), bf16(5, 40000),
                                                            bf16(40000), 1e-6),
    "rms_norm: weight shape": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), bf16(5, 4096), bf16(4088), 1e-6),
    "rms_norm: float32 weight": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), bf16(5, 4096), f32(4096), 1e-6),
    "rms_norm: float32 x": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), f32(5, 4096), bf16(4096), 1e-6),
    "rms_norm: out shape": lambda lib: norm.rms_norm(lib, None, bf16(6, 4096), bf16(5, 4096), bf16(4096), 1e-6),
    "rms_norm: 1-D x": lambda lib: norm.rms_norm(lib, None, bf16(4096), bf16(4096), bf16(4096), 1e-6),
    "rms_norm: residual without residual_out": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), bf16(5, 4096),
                                                                         bf16(4096), 1e-6, bf16(5, 4096)),
    "rms_norm: residual shape": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), bf16(5, 4096), bf16(4096), 1e-6,
                                                          bf16(4, 4096), bf16(5, 4096)),
    "rms_norm: residual_out shape": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), bf16(5, 4096), bf16(4096),
                                                              1e-6, None, bf16(5, 4088)),
    "rms_norm: x row stride not 16-byte": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096),
                                                                    bf16(5, 4096, row_stride=4100), bf16(4096), 1e-6),
    "rms_norm: misaligned out": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096, offset=8), bf16(5, 4096),
                                                          bf16(4096), 1e-6),
    "rms_norm: misaligned weight": lambda lib: norm.rms_norm(lib, None, bf16(5, 4096), bf16(5, 4096),
                                                             bf16(4096, offset=8), 1e-6),
    "head_rms_norm: odd head_dim": lambda lib: norm.head_rms_norm(lib, None, bf16(3, 28), bf16(7), 1e-6, 7),
    "head_rms_norm: head_dim too large": lambda lib: norm.head_rms_norm(lib, None, bf16(3, 1024), bf16(512), 1e-6,
                                                                        512),
    "head_rms_norm: width not a multiple": lambda lib: norm.head_rms_norm(lib, None, bf16(3, 500), bf16(128), 1e-6,
                                                                          128),
    "head_rms_norm: weight shape": lambda lib: norm.head_rms_norm(lib, None, bf16(3, 512), bf16(64), 1e-6, 128),
    "head_rms_norm: float32 x": lambda lib: norm.head_rms_norm(lib, None, f32(3, 512), bf16(128), 1e-6, 128),
    "head_rms_norm: misaligned x": lambda lib: norm.head_rms_norm(lib, None, bf16(3, 512, offset=2), bf16(128),
                                                                  1e-6, 128),
    "head_rms_norm: odd row stride": lambda lib: norm.head_rms_norm(lib, None, bf16(3, 512, row_stride=513),
                                                                    bf16(128), 1e-6, 128),
    "layer_norm: bias shape": lambda lib: norm.layer_norm(lib, None, bf16(5, 4096), bf16(5, 4096), bf16(4096),
                                                          bf16(4088), 1e-5),
    "layer_norm: float32 bias": lambda lib: norm.layer_norm(lib, None, bf16(5, 4096), bf16(5, 4096), bf16(4096),
                                                            f32(4096), 1e-5),
    "layer_norm: hidden not a multiple of 8": lambda lib: norm.layer_norm(lib, None, bf16(5, 100), bf16(5, 100),
                                                                          bf16(100), bf16(100), 1e-5),
    "layer_norm_partials: partials rows": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(15, H), 4, bf16(H), bf16(H), bf16(H), 1e-5, bf16(5, H), bf16(5, H)),
    "layer_norm_partials: 9 partials": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(45, H), 9, bf16(H), bf16(H), bf16(H), 1e-5, bf16(5, H), bf16(5, H)),
    "layer_norm_partials: bf16 partials": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), bf16(20, H), 4, bf16(H), bf16(H), bf16(H), 1e-5, bf16(5, H), bf16(5, H)),
    "layer_norm_partials: strided partials": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(20, H, row_stride=H + 8), 4, bf16(H), bf16(H), bf16(H), 1e-5, bf16(5, H),
        bf16(5, H)),
    "layer_norm_partials: linear bias shape": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(20, H), 4, bf16(H - 8), bf16(H), bf16(H), 1e-5, bf16(5, H), bf16(5, H)),
    "layer_norm_partials: no residual": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(20, H), 4, bf16(H), bf16(H), bf16(H), 1e-5, None, bf16(5, H)),
    "layer_norm_partials: residual shape": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(20, H), 4, bf16(H), bf16(H), bf16(H), 1e-5, bf16(6, H), bf16(5, H)),
    "layer_norm_partials: misaligned partials": lambda lib: norm.layer_norm_partials(
        lib, None, bf16(5, H), f32(20, H, offset=4), 4, None, bf16(H), bf16(H), 1e-5, bf16(5, H), bf16(5, H)),
    "layer_norm_gathered: table width": lambda lib: gathered_norm(lib, x_table=bf16(100, H + 8)),
    "layer_norm_gathered: float32 table": lambda lib: gathered_norm(lib, residual_table=f32(40, H)),
    "layer_norm_gathered: misaligned table": lambda lib: gathered_norm(lib, x_table=bf16(100, H, offset=4)),
    "layer_norm_gathered: row count": lambda lib: gathered_norm(lib, x_rows=i32(6)),
    "layer_norm_gathered: int64-sized rows": lambda lib: gathered_norm(lib, residual_rows=f32(5)),
    "layer_norm_gathered: residual_out shape": lambda lib: gathered_norm(lib, residual_out=bf16(5, H + 8)),
    "relu: shapes differ": lambda lib: activation.relu(lib, None, bf16(3, 96), bf16(3, 104)),
    "relu: width not a multiple of 8": lambda lib: activation.relu(lib, None, bf16(3, 100), bf16(3, 100)),
    "relu: float32 x": lambda lib: activation.relu(lib, None, bf16(3, 96), f32(3, 96)),
    "silu_mul: I not a multiple of 8": lambda lib: activation.silu_mul(lib, None, bf16(3, 100), bf16(3, 200)),
    "silu_mul: gate_up width": lambda lib: activation.silu_mul(lib, None, bf16(3, 96), bf16(3, 200)),
    "silu_mul: gate_up rows": lambda lib: activation.silu_mul(lib, None, bf16(3, 96), bf16(4, 192)),
    "silu_mul: float32 gate_up": lambda lib: activation.silu_mul(lib, None, bf16(3, 96), f32(3, 192)),
    "silu_mul: misaligned out": lambda lib: activation.silu_mul(lib, None, bf16(3, 96, offset=8), bf16(3, 192)),
    "silu_mul: gate_up row stride not 16-byte": lambda lib: activation.silu_mul(lib, None, bf16(3, 96),
                                                                                bf16(3, 192, row_stride=196)),
    "rope: qkv width": rope_call(qkv=bf16(5, QKV_WIDTH + 8)),
    "rope: float32 qkv": rope_call(qkv=f32(5, QKV_WIDTH)),
    "rope: head_dim not a multiple of 8": rope_call(head_dim=12),
    "rope: no kv heads": rope_call(kv_heads=0),
    "rope: misaligned qkv": rope_call(qkv=bf16(5, QKV_WIDTH, offset=4)),
    "rope: bfloat16 cos": rope_call(cos=bf16(P, HEAD_DIM // 2)),
    "rope: cos width": rope_call(cos=f32(P, HEAD_DIM)),
    "rope: sin shape differs": rope_call(sin=f32(P + 1, HEAD_DIM // 2)),
    "rope: misaligned cos": rope_call(cos=f32(P, HEAD_DIM // 2, offset=4)),
    "rope: strided sin": rope_call(sin=f32(P, HEAD_DIM // 2, row_stride=HEAD_DIM)),
    "rope: int64 positions": rope_call(positions=DeviceTensor(BASE, (5,), "int64")),
    "rope: slot_mapping length": rope_call(slots=i32(4)),
    "rope: kv heads of the cache": rope_call(kv=bf16(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS + 1, HEAD_DIM)),
    "rope: 4-D cache": rope_call(kv=bf16(2, NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM)),
    "rope: float32 cache": rope_call(kv=f32(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)),
    "rope: three planes": rope_call(kv=bf16(3, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_are_rejected_before_any_kernel(case, launches):
    lib = FakeLibrary()
    with pytest.raises(InvalidArgument):
        BAD_CALLS[case](lib)
    assert lib.requested == [] and launches == []


def test_embedding_launch(launches):
    lib = FakeLibrary()
    embedding.embedding(lib, None, bf16(T, 4096), bf16(V, 4096), i32(T))
    embedding.embedding(lib, None, bf16(T, H), bf16(V, H, offset=2), i32(T))   # 2-byte aligned table: 2-byte copy
    embedding.embedding(lib, None, bf16(0, H), bf16(V, H), i32(0))              # no tokens: no launch
    assert [(name, grid) for name, grid, _, _ in launches] == [("gather_rows_16b", (T, 2)), ("gather_rows_2b", (T, 1))]
    assert launches[0][3][-2:] == [V, 4096 * 2 // 16]   # vocab bound, 16-byte units per row


@pytest.mark.parametrize("out, x, kernel, grid", [
    (bf16(3, 4096), bf16(300, 4096), "gather_rows_16b", (3, 2)),
    (f32(3, 151936), f32(33, 151936), "gather_rows_16b", (3, ceil_div(151936 * 4 // 16, 256))),
    (f32(2, 50257), f32(5, 50257), "gather_rows_4b", (2, ceil_div(50257, 256))),
    (bf16(5, 4095, row_stride=4103), bf16(17, 4095, offset=6, row_stride=4100), "gather_rows_2b", (5, 16)),
    (bf16(1, 64), bf16(9, 64, offset=16, row_stride=80), "gather_rows_16b", (1, 1)),
])
def test_gather_rows_picks_the_widest_copy(launches, out, x, kernel, grid):
    gather_rows_rows = i32(out.shape[0])
    embedding.gather_rows(FakeLibrary(), None, out, x, gather_rows_rows)
    [(name, got_grid, _, args)] = launches
    assert (name, got_grid) == (kernel, grid)
    unit = int(kernel.removeprefix("gather_rows_").removesuffix("b"))
    assert args[1] == out.stride * out.itemsize // unit and args[3] == x.stride * x.itemsize // unit


@pytest.mark.parametrize("hidden, block", [(24, 32), (64, 32), (4096, 512), (8192, 1024), (32768, 1024)])
def test_rms_norm_block_size(launches, hidden, block):
    norm.rms_norm(FakeLibrary(), None, bf16(5, hidden), bf16(5, hidden), bf16(hidden), 1e-6)
    [(name, grid, got_block, args)] = launches
    assert (name, grid, got_block) == ("rms_norm", (5,), block)
    assert args[2] == 0 and args[6] == 0   # no residual_out, no residual: null pointers


def gathered_norm(lib, x_table=None, x_rows=None, residual_table=None, residual_rows=None, residual_out=None):
    """layer_norm_gathered over 5 rows of width H: a 100-row token table (a column slice) and a 40-row position
    table, unless given."""
    norm.layer_norm_gathered(lib, None, bf16(5, H), residual_out or bf16(5, H),
                             x_table or bf16(100, H, row_stride=H + 8), x_rows or i32(5), residual_table or bf16(40, H),
                             residual_rows or i32(5), bf16(H), bf16(H), 1e-5)


def test_layer_norm_gathered_launch(launches):
    gathered_norm(FakeLibrary())
    [(name, grid, block, args)] = launches
    assert (name, grid, block) == ("layer_norm_gathered", (5,), 32)          # H // 8 units: one warp
    assert args[5] == H + 8 and args[7] == 100 and args[9] == H and args[11] == 40     # strides, table rows


class SmallBlocksLibrary(FakeLibrary):
    """A kernel whose registers allow 480 threads a block, as layer_norm_partials' do."""

    def max_block(self, kernel_name, module):
        return 480


@pytest.mark.parametrize("hidden, block", [(1024, 128), (3840, 480), (12288, 480)])
def test_norm_blocks_stay_within_the_kernels_limit(launches, hidden, block):
    rows, partials = bf16(3, hidden), f32(3 * 4, hidden)
    norm.layer_norm_partials(SmallBlocksLibrary(), None, rows, partials, 4, None, bf16(hidden), bf16(hidden), 1e-5,
                             bf16(3, hidden), bf16(3, hidden))
    [(name, _, got_block, _)] = launches
    assert (name, got_block) == ("layer_norm_partials", block)


def test_a_norm_too_wide_for_the_kernels_blocks_is_refused(launches):
    hidden = 4 * 8 * 480 + 8          # four 16-byte units a thread at most
    with pytest.raises(InvalidArgument, match="480-thread blocks"):
        norm.layer_norm_partials(SmallBlocksLibrary(), None, bf16(3, hidden), f32(12, hidden), 4, None, bf16(hidden),
                                 bf16(hidden), 1e-5, bf16(3, hidden), bf16(3, hidden))
    assert launches == []


def test_rms_norm_residual_pointers(launches):
    x, residual, residual_out = bf16(5, 64, offset=0), bf16(5, 64, offset=1024), bf16(5, 64, offset=2048)
    norm.rms_norm(FakeLibrary(), None, bf16(5, 64, offset=4096), x, bf16(64), 1e-5, residual, residual_out)
    [(_, _, _, args)] = launches
    assert args[0] == BASE + 4096 and args[2] == residual_out.ptr and args[4] == x.ptr and args[6] == residual.ptr
    assert args[-1] == np.float32(1e-5)


def test_head_rms_norm_launch(launches):
    qkv = bf16(3, (4 + 2 * 2) * 128)
    norm.head_rms_norm(FakeLibrary(), None, qkv.columns(4 * 128, 6 * 128), bf16(128), 1e-6, 128)   # k heads
    [(name, grid, block, args)] = launches
    assert (name, grid, block) == ("head_rms_norm", (ceil_div(3 * 2, 4),), 128)
    assert args[0] == qkv.ptr + 4 * 128 * 2 and args[1] == 8 * 128 and args[3:6] == [3, 2, 128]


def test_silu_mul_launch(launches):
    activation.silu_mul(FakeLibrary(), None, bf16(300, 14336), bf16(300, 2 * 14336))
    [(name, grid, block, args)] = launches
    assert (name, grid, block) == ("silu_mul", (ceil_div(300 * 14336 // 8, 256),), 256)
    assert args[1] == 14336 // 8 and args[3] == 2 * 14336 // 8 and args[4:] == [300, 14336 // 8]


def test_rope_and_write_kv_launch(launches):
    rope_call()(FakeLibrary())
    rope_kv.rope_and_write_kv(FakeLibrary(), None, bf16(0, QKV_WIDTH), f32(P, 8), f32(P, 8), i32(0), i32(0),
                              bf16(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), HEADS, KV_HEADS, HEAD_DIM)
    [(name, grid, block, args)] = launches
    items = (HEADS + 2 * KV_HEADS) * HEAD_DIM // 8
    assert (name, grid, block) == ("rope_and_write_kv", (5, ceil_div(items, 128)), 128)
    assert args[1] == QKV_WIDTH and args[7] == 0 and args[8:] == [NUM_BLOCKS * BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM]


def test_rope_and_write_kv_into_an_fp8_cache(launches):
    rope_kv.rope_and_write_kv(FakeLibrary(), None, bf16(5, QKV_WIDTH), f32(P, 8), f32(P, 8), i32(5), i32(5),
                              fp8_kv(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), HEADS, KV_HEADS, HEAD_DIM)
    [(name, _, _, args)] = launches
    assert name == "rope_and_write_kv_fp8" and args[7] == BASE + (1 << 28)     # the cache's scales


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("m", [1, 9])
def test_an_fp8_weight_s_decode_linear_launches_its_form_s_kernel(launches, m, blocks):
    """A scale a row or a row per 128 columns: the skinny GEMM's entry for the form, the scales after the weight."""
    n, k = 48, 256
    scales = f32(k // 128, n, offset=1 << 24) if blocks else f32(n, offset=1 << 24)
    weight = Fp8Matrix(DeviceTensor(BASE, (n, k), "float8_e4m3"), scales, blocks)
    skinny_gemm.skinny_linear(FakeLibrary(), None, bf16(m, n), bf16(m, k), weight)
    [(name, grid, _, args)] = launches
    assert name == f"skinny_gemm_m{8 if m <= 8 else 16}_fp8{'_blocks' if blocks else ''}"
    assert grid == (ceil_div(n, 16),) and args[5] == BASE + (1 << 24) and args[7:10] == [m, n, k // 8]


@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8_blocks"])
@pytest.mark.parametrize("m", [1, 9])
def test_a_gated_mlp_s_gate_up_and_activation_launch_as_one(launches, m, form):
    """[gate; up] of 2 x 24 rows: 3 CTAs of 8 out columns each; the scales after the weight (null for bf16)."""
    half, k = 24, 256
    if form == "bf16":
        weight = bf16(2 * half, k)
    else:
        scales = f32(k // 128, 2 * half, offset=1 << 24) if form == "fp8_blocks" else f32(2 * half, offset=1 << 24)
        weight = Fp8Matrix(DeviceTensor(BASE, (2 * half, k), "float8_e4m3"), scales, form == "fp8_blocks")
    out = bf16(m, half, row_stride=half + 8)
    skinny_gemm.skinny_gated(FakeLibrary(), None, out, bf16(m, k), weight)
    [(name, grid, _, args)] = launches
    assert name == f"skinny_gated_m{8 if m <= 8 else 16}_{form}" and grid == (3,)
    assert args[1] == half + 8 and args[5] == (0 if form == "bf16" else BASE + (1 << 24)) and args[6:] == [m, half,
                                                                                                          k // 8]


@pytest.mark.parametrize("case, out, weight, x", [
    ("halves not a multiple of 8", bf16(2, 20), bf16(40, 64), bf16(2, 64)),
    ("out of the product's width", bf16(2, 48), bf16(48, 64), bf16(2, 64)),
    ("float32 out", f32(2, 24), bf16(48, 64), bf16(2, 64)),
    ("over 16 rows", bf16(17, 24), bf16(48, 64), bf16(17, 64)),
    ("K disagrees", bf16(2, 24), bf16(48, 72), bf16(2, 64))])
def test_a_gated_gate_up_that_cannot_run_is_refused_before_any_kernel(launches, case, out, weight, x):
    lib = FakeLibrary()
    with pytest.raises(InvalidArgument, match="skinny_gated"):
        skinny_gemm.skinny_gated(lib, None, out, x, weight)
    assert lib.requested == [] and launches == []


def test_an_input_quantized_by_128_columns_launches_a_ctas_a_row(launches):
    m, k = 5, 512
    fp8.quantize_groups(FakeLibrary(), None, DeviceTensor(BASE, (m, k), "float8_e4m3"), f32(k // 128, m), bf16(m, k))
    [(name, grid, _, args)] = launches
    assert (name, grid) == ("quantize_groups_e4m3", (m,)) and args[4:] == [k // 8, m]
