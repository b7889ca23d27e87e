"""moe_route.cu's and moe.cu's launchers without a GPU: a layer's launches (route with its grouping, the two grouped
GEMMs, combine) match each kernel's parameter list, their grids follow the row count alone (so a decode graph replays
them as captured), and bad shapes are refused before anything is launched."""

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import FakeLibrary, bf16, f32, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix  # noqa: E402
from metrale.runtime.backend.cuda.kernels import moe  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768


def routed(tokens: int, experts: int = EXPERTS, top_k: int = TOP_K) -> moe.Routed:
    entries = tokens * top_k
    rows = moe.tile_rows(entries, experts)
    return moe.Routed(i32(tokens, top_k), f32(tokens, top_k), i32(experts + 1), i32(entries), i32(entries),
                      i32(moe.max_tiles(entries, experts, rows), 2), i32(1), rows)


def experts(fp8: str, *shape: int):
    """Experts' weights [E, N, K]: bf16 (fp8 ""), or FP8 as the backend uploads them: e4m3 with a scale a row
    ("rows") or a row's per 128 columns ("blocks")."""
    if not fp8:
        return bf16(*shape)
    e, n, k = shape
    scales = f32(e, k // 128, n) if fp8 == "blocks" else f32(e, n)
    return Fp8Matrix(DeviceTensor(1 << 30, shape, "float8_e4m3"), scales, blocks=fp8 == "blocks")


def layer(lib, tokens: int, bias: bool = False, fp8: str = "") -> None:
    r = routed(tokens)
    entries = tokens * TOP_K
    moe.route(lib, None, r, f32(tokens, EXPERTS), TOP_K, not bias, True, f32(EXPERTS) if bias else None,
              8 if bias else 1, 4 if bias else 1, 2.5, i32(1))
    moe.grouped_gemm(lib, None, bf16(entries, WIDTH), bf16(tokens, HIDDEN), experts(fp8, EXPERTS, 2 * WIDTH, HIDDEN),
                     r, TOP_K, gated=True)
    moe.grouped_gemm(lib, None, bf16(entries, HIDDEN), bf16(entries, WIDTH), experts(fp8, EXPERTS, HIDDEN, WIDTH), r, 0)
    moe.combine(lib, None, bf16(tokens, HIDDEN), bf16(entries, HIDDEN), r, bf16(tokens, HIDDEN))


@pytest.mark.parametrize("fp8", ["", "rows", "blocks"])
@pytest.mark.parametrize("tokens, bias", [(1, False), (64, True), (256, False), (8192, True)])
def test_a_layers_launches_match_the_kernels(monkeypatch, tokens, bias, fp8):
    launches = record_launches(monkeypatch, moe)
    layer(FakeLibrary(), tokens, bias, fp8)
    names = [name for (_, name), *_ in launches]
    gemm = moe.TILE_ROWS[moe.tile_rows(tokens * TOP_K, EXPERTS)]
    gated = gemm + ("_gated" if "grouped" in gemm else "")      # the tiled GEMM's activation: its own kernel
    suffix = {"": "", "rows": "_fp8", "blocks": "_fp8_blocks"}[fp8]
    assert names == ["moe_route", gated + suffix, gemm + suffix, "moe_combine"]
    for (module, name), grid, block, args, _ in launches:
        if "grouped" in name:
            macro = "MOE_GROUPED_GEMM_FP8" if fp8 else "MOE_GROUPED_GEMM"
        else:                   # the bf16 skinny GEMM is declared as itself
            macro = "MOE_SKINNY_GEMM_FP8" if fp8 and "skinny" in name else None
        assert [type(a) for a in args] == parameter_types(module, name, macro), name
        grid = grid if isinstance(grid, tuple) else (grid,)
        assert all(0 < g <= 65535 for g in grid[1:]) and 0 < grid[0] < 2 ** 31, (name, grid)
        assert 32 <= block <= 1024 and block % 32 == 0
    # The grouped GEMMs' grids: every tile a sort can make, whatever the routing.
    entries = tokens * TOP_K
    rows = moe.tile_rows(entries, EXPERTS)
    assert launches[1][1][1] == moe.max_tiles(entries, EXPERTS, rows)


def test_max_tiles_bounds_every_routing():
    rng = np.random.default_rng(0)
    for _ in range(200):
        experts, entries = int(rng.integers(1, 64)), int(rng.integers(1, 2000))
        rows = moe.tile_rows(entries, experts)
        counts = np.bincount(rng.integers(0, experts, entries), minlength=experts)
        assert sum(-(-c // rows) for c in counts) <= moe.max_tiles(entries, experts, rows)


def route_4(lib, experts: int, held_k: int, top_k: int, n_group: int = 1, topk_group: int = 1, done=None) -> None:
    """moe.route over 4 tokens' logits into buffers for top-held_k."""
    moe.route(lib, None, routed(4, experts, held_k), f32(4, experts), top_k, n_group == 1, True, None, n_group,
              topk_group, 1.0, i32(1) if done is None else done)


@pytest.mark.parametrize("call", [
    lambda lib: route_4(lib, 600, 8, 8),                        # more than 512 experts
    lambda lib: route_4(lib, 64, 8, 8, n_group=64, topk_group=2),  # groups of one expert
    lambda lib: route_4(lib, 64, 9, 9, n_group=8, topk_group=1),   # top-9 from one group of 8
    lambda lib: route_4(lib, 64, 4, 8),                         # ids [4, 4] for top-8
    lambda lib: route_4(lib, 64, 8, 8, done=f32(1)),            # a float counter
    lambda lib: moe.grouped_gemm(lib, None, bf16(32, 100), bf16(4, 60), bf16(8, 100, 60), routed(4, 8, 8), 8),
    lambda lib: moe.grouped_gemm(lib, None, bf16(32, 100), bf16(4, 64), bf16(8, 200, 64), routed(4, 8, 8), 8,
                                 gated=True),                   # a gated width not a multiple of 8
    lambda lib: moe.grouped_gemm(lib, None, bf16(32, 192), bf16(4, 64), bf16(8, 192, 64), routed(4, 8, 8), 8,
                                 gated=True),                   # gated out as wide as the gate and up
    lambda lib: moe.grouped_gemm(lib, None, bf16(32, 64), bf16(4, 192), experts("blocks", 8, 64, 192),
                                 routed(4, 8, 8), 8),           # FP8 blocks with K not a multiple of 128
    lambda lib: moe.grouped_gemm(lib, None, bf16(32, 64), bf16(4, 256), Fp8Matrix(
        DeviceTensor(1 << 30, (8, 64, 256), "float8_e4m3"), f32(8, 64), blocks=True), routed(4, 8, 8), 8),
    lambda lib: moe.grouped_gemm(lib, None, bf16(32, 64), bf16(4, 248), experts("rows", 8, 64, 248),
                                 routed(4, 8, 8), 8),           # FP8 rows with K not a multiple of 16
    lambda lib: moe.combine(lib, None, bf16(4, 64), bf16(4, 64), routed(4, 8, 8)),
])
def test_bad_shapes_are_refused_before_a_launch(monkeypatch, call):
    launches = record_launches(monkeypatch, moe)
    lib = FakeLibrary()
    with pytest.raises(InvalidArgument):
        call(lib)
    assert launches == [] and lib.requested == []
