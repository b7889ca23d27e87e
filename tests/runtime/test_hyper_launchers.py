"""hyper.cu's launchers without a GPU: their arguments match each kernel's parameter list, one CTA per token (with the
token's streams as bf16 in shared memory), a few tokens' rows split into pieces that meet in a scratch, or a flat grid
over 16-byte units, and bad shapes are refused before anything is launched."""

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import FakeLibrary, bf16, f32, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda.kernels import hyper  # noqa: E402
from metrale.runtime.backend.layer_math import HyperConnection, HyperHead, RmsNorm  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

HY4 = dict(hc_mult=4, hidden=2816, iters=0)
DEEPSEEK_V4 = dict(hc_mult=4, hidden=7168, iters=20)


def connection(hc_mult, hidden, iters, rows=None, scales=None):
    rows = rows or 2 * hc_mult + (hc_mult ** 2 if iters else 0)
    return HyperConnection(f32(rows, hc_mult * hidden), f32(rows), f32(scales or (3 if iters else 2)), hc_mult, 1e-6,
                           1e-6, 2.0, 1e-6 if not iters else 0.0, iters)


def mix(tokens, hc_mult, iters):
    return f32(tokens, hc_mult), f32(tokens, hc_mult * hc_mult) if iters else None


def scratch():
    return hyper.Scratch(f32(hyper.PIECE_CTAS * (hyper.MAX_ROWS + 1)), i32(hyper.PIECE_CTAS // 2))


def only_launch(recorded, name):
    assert len(recorded) == 1
    (module, kernel), grid, block, args, shmem = recorded[0]
    assert kernel == name
    assert [type(a) for a in args] == parameter_types(module, kernel)
    return grid, block, args, shmem


@pytest.mark.parametrize("shape", [HY4, DEEPSEEK_V4])
def test_collapse_is_a_cta_per_token(monkeypatch, shape):
    recorded = record_launches(monkeypatch, hyper)
    n, hidden, iters = shape["hc_mult"], shape["hidden"], shape["iters"]
    post, comb = mix(7, n, iters)
    hyper.collapse(FakeLibrary(), None, bf16(7, hidden), post, comb, bf16(7, n * hidden), connection(n, hidden, iters))
    grid, block, args, shmem = only_launch(recorded, "hyper_collapse")
    assert grid == (7, 1) and block == hyper.THREADS and shmem == 2 * n * hidden
    assert args[3] == (np.uint64(0) if comb is None else comb.ptr)
    assert args[15] == iters and args[9:11] == [n, hidden] and args[-3:] == [0, 0, hidden // 8]


@pytest.mark.parametrize("shape", [HY4, DEEPSEEK_V4])
def test_boundary_is_a_cta_per_token(monkeypatch, shape):
    recorded = record_launches(monkeypatch, hyper)
    n, hidden, iters = shape["hc_mult"], shape["hidden"], shape["iters"]
    post, comb = mix(300, n, iters)
    streams = bf16(300, n * hidden + 64, row_stride=n * hidden + 64).columns(0, n * hidden)
    hyper.boundary(FakeLibrary(), None, bf16(300, hidden), streams, post, comb, bf16(300, hidden),
                   connection(n, hidden, iters))
    grid, block, args, shmem = only_launch(recorded, "hyper_boundary")
    assert grid == (300, 1) and block == hyper.THREADS and shmem == 2 * n * hidden
    assert args[1] == n * hidden + 64 and args[17] == iters and args[-1] == hidden // 8


@pytest.mark.parametrize("tokens, slices, span", [(1, 44, 8), (7, 36, 10), (64, 4, 88), (128, 2, 176), (129, 1, 352)])
def test_a_few_tokens_are_split_into_pieces_that_meet_in_the_scratch(monkeypatch, tokens, slices, span):
    recorded = record_launches(monkeypatch, hyper)
    n, hidden, iters, held = HY4["hc_mult"], HY4["hidden"], HY4["iters"], scratch()
    post, comb = mix(tokens, n, iters)
    hyper.boundary(FakeLibrary(), None, bf16(tokens, hidden), bf16(tokens, n * hidden), post, comb,
                   bf16(tokens, hidden), connection(n, hidden, iters), held)
    grid, block, args, shmem = only_launch(recorded, "hyper_boundary")
    assert grid == (tokens, slices) and shmem == 16 * n * span
    assert args[-3:] == [held.partials.ptr, held.arrivals.ptr, span]


def test_a_norm_goes_with_the_collapse(monkeypatch):
    recorded = record_launches(monkeypatch, hyper)
    weight, post, comb = bf16(2816), *mix(3, 4, 0)
    hyper.boundary(FakeLibrary(), None, bf16(3, 2816), bf16(3, 4 * 2816), post, comb, bf16(3, 2816),
                   connection(4, 2816, 0), scratch(), RmsNorm(weight, 1e-5))
    hyper.head(FakeLibrary(), None, bf16(3, 2816), bf16(3, 4 * 2816), HyperHead(f32(4, 4 * 2816), f32(4), f32(1), 4,
                                                                                  1e-6, 1e-6))
    (_, _, _, boundary_args, _), (_, _, _, head_args, _) = recorded
    assert boundary_args[18] == weight.ptr and boundary_args[19] == np.float32(1e-5)
    assert head_args[11:13] == [0, 0.0]                 # none: the input as the collapse leaves it


@pytest.mark.parametrize("hidden", [64, 2816, 7168, 8200])
def test_pieces_cover_the_row_and_fit_the_scratch(hidden):
    groups = hidden // 8
    for tokens in range(1, 300):
        slices, span = hyper.pieces(tokens, hidden, scratch())
        assert (slices - 1) * span < groups <= slices * span          # every unit in one piece, none empty
        if slices > 1:
            assert span >= hyper.MIN_SPAN and tokens * slices <= hyper.PIECE_CTAS
            assert tokens <= hyper.PIECE_CTAS // 2                    # arrivals has a counter for each token
    assert hyper.pieces(1, hidden, None) == (1, groups)


def test_head_is_a_cta_per_token(monkeypatch):
    recorded = record_launches(monkeypatch, hyper)
    head = HyperHead(f32(4, 4 * 2816), f32(4), f32(1), 4, 1e-6, 1e-6)
    hyper.head(FakeLibrary(), None, bf16(1, 2816), bf16(1, 4 * 2816), head)
    grid, block, _, shmem = only_launch(recorded, "hyper_head")
    assert grid == (1, 1) and block == hyper.THREADS and shmem == 2 * 4 * 2816


@pytest.mark.parametrize("with_comb", [False, True])
def test_expand_is_a_flat_grid_over_units(monkeypatch, with_comb):
    recorded = record_launches(monkeypatch, hyper)
    post, comb = mix(7, 4, with_comb)
    streams = bf16(7, 4 * 64)
    hyper.expand(FakeLibrary(), None, streams, bf16(7, 64), streams, post, comb)
    grid, block, args, _ = only_launch(recorded, "hyper_expand")
    assert grid == 1 and block == hyper.THREADS        # 7 tokens x 8 units
    assert args[1] == args[5] == 4 * 64 // 8 and args[3] == 64 // 8 and args[-3:] == [7, 4, 8]


def test_widen_is_a_flat_grid_over_units(monkeypatch):
    recorded = record_launches(monkeypatch, hyper)
    hyper.widen(FakeLibrary(), None, bf16(300, 4 * 2816), bf16(300, 2816), 4)
    grid, block, args, _ = only_launch(recorded, "hyper_widen")
    assert grid == -(-300 * 352 // 256) and block == hyper.THREADS and args[-3:] == [300, 4, 352]


def test_no_tokens_launch_nothing(monkeypatch):
    recorded = record_launches(monkeypatch, hyper)
    post, comb = mix(0, 4, 20)
    hyper.collapse(FakeLibrary(), None, bf16(0, 64), post, comb, bf16(0, 256), connection(4, 64, 20))
    hyper.widen(FakeLibrary(), None, bf16(0, 256), bf16(0, 64), 4)
    assert not recorded


def collapse(x=None, streams=None, post=None, comb="default", hc=None, iters=20):
    def call(lib):
        default_post, default_comb = mix(5, 4, iters)
        hyper.collapse(lib, None, x or bf16(5, 64), post or default_post, default_comb if comb == "default" else comb,
                       streams or bf16(5, 256), hc or connection(4, 64, iters))
    return call


@pytest.mark.parametrize("call", [
    collapse(streams=bf16(5, 192)),                                      # three streams' width for hc_mult 4
    collapse(x=bf16(5, 60), streams=bf16(5, 240)),                       # hidden not a multiple of 8
    collapse(comb=None),                                                 # Sinkhorn's comb with nowhere to go
    collapse(iters=0, comb=f32(5, 16)),                                  # a comb where the connection has none
    collapse(hc=connection(4, 64, 20, rows=8)),                          # fn without the comb's rows
    collapse(hc=connection(4, 64, 20, scales=2)),                        # no comb scale
    collapse(post=f32(5, 3)),                                            # post of another hc_mult
    collapse(post=bf16(5, 4)),                                           # post in bf16
    collapse(streams=bf16(5, 260, row_stride=260).columns(0, 256)),      # rows not 16-byte aligned
    collapse(x=bf16(5, 64, offset=2)),
    lambda lib: hyper.collapse(lib, None, bf16(5, 64), *mix(5, 9, 0), bf16(5, 9 * 64), connection(9, 64, 0)),
    lambda lib: hyper.collapse(lib, None, bf16(5, 16384), *mix(5, 8, 0), bf16(5, 8 * 16384),
                               connection(8, 16384, 0)),                 # more than shared memory holds
    lambda lib: hyper.expand(lib, None, bf16(5, 128), bf16(5, 64), bf16(5, 256), *mix(5, 4, 20)),
    lambda lib: hyper.boundary(lib, None, bf16(5, 64), bf16(5, 256), *mix(5, 4, 20), bf16(4, 64),
                               connection(4, 64, 20)),                   # out of another token count
    lambda lib: hyper.head(lib, None, bf16(5, 64), bf16(5, 256), HyperHead(f32(4, 256), f32(4), f32(2), 4, 1e-6,
                                                                             1e-6)),
    lambda lib: hyper.widen(lib, None, bf16(5, 256), bf16(5, 64), 3),
    lambda lib: hyper.collapse(lib, None, bf16(5, 64), *mix(5, 4, 0), bf16(5, 256), connection(4, 64, 0),
                               hyper.Scratch(f32(100), i32(128))),              # too few partials
    lambda lib: hyper.head(lib, None, bf16(5, 64), bf16(5, 256), HyperHead(f32(4, 256), f32(4), f32(1), 4, 1e-6,
                                                                             1e-6), hyper.Scratch(*scratch()[::-1])),
    lambda lib: hyper.collapse(lib, None, bf16(5, 64), *mix(5, 4, 0), bf16(5, 256), connection(4, 64, 0), None,
                               RmsNorm(bf16(32), 1e-5)),                 # a norm of another width
    lambda lib: hyper.collapse(lib, None, bf16(5, 64), *mix(5, 4, 0), bf16(5, 256), connection(4, 64, 0), None,
                               RmsNorm(f32(64), 1e-5)),                  # a float32 norm weight
])
def test_bad_shapes_are_refused_before_a_launch(monkeypatch, call):
    recorded = record_launches(monkeypatch, hyper)
    with pytest.raises(InvalidArgument):
        call(FakeLibrary())
    assert not recorded


def test_every_kernel_has_a_launcher(monkeypatch):
    recorded, lib = record_launches(monkeypatch, hyper), FakeLibrary()
    post, comb = mix(2, 4, 20)
    hyper.widen(lib, None, bf16(2, 256), bf16(2, 64), 4)
    hyper.collapse(lib, None, bf16(2, 64), post, comb, bf16(2, 256), connection(4, 64, 20))
    hyper.expand(lib, None, bf16(2, 256), bf16(2, 64), bf16(2, 256), post, comb)
    hyper.boundary(lib, None, bf16(2, 64), bf16(2, 256), post, comb, bf16(2, 64), connection(4, 64, 20))
    hyper.head(lib, None, bf16(2, 64), bf16(2, 256), HyperHead(f32(4, 256), f32(4), f32(1), 4, 1e-6, 1e-6),
               scratch())
    assert {name for _, name in lib.requested} == {"hyper_widen", "hyper_collapse", "hyper_expand", "hyper_boundary",
                                                   "hyper_head"} and len(recorded) == 5
