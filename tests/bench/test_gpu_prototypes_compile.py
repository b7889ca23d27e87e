"""The GPU prototypes of bench/ that are measured before anything is built on them (bench/gpu_persistent_gemm.py,
bench/gpu_persistent_layer.py, bench/gpu_grid_barrier.py) compile for Hopper and Ampere and describe splits the kernel can run; no GPU needed (their figures and their
check against torch come from running them on the H200)."""

from pathlib import Path

import pytest

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.compiler import compile_cubin, with_headers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def persistent_gemm(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.gpu_persistent_gemm

    return bench.gpu_persistent_gemm


def test_headers_are_inlined_for_a_source_outside_the_kernel_folder(persistent_gemm):
    source = with_headers(persistent_gemm.SOURCE)
    assert "#include" not in source and source.count("__device__ __forceinline__ void mma_bf16(") == 1


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_persistent_gemm_compiles(persistent_gemm, arch):
    assert compile_cubin("persistent_gemm", with_headers(persistent_gemm.SOURCE), arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_persistent_layer_compiles_with_the_layout_the_host_packs(monkeypatch, arch):
    """The kernel's static_assert holds Layer at LAYER_BYTES, which the host's record must match."""
    monkeypatch.syspath_prepend(str(ROOT))
    import numpy as np

    import bench.gpu_persistent_layer as layer

    assert np.dtype(layer.LAYER_FIELDS).itemsize == layer.LAYER_BYTES
    assert compile_cubin("persistent_layer", with_headers(layer.SOURCE), arch)[:4] == b"\x7fELF"
    for split in layer.LINEARS:
        split.check()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_both_grid_barriers_compile(monkeypatch, arch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.gpu_grid_barrier

    assert compile_cubin("grid_barrier", bench.gpu_grid_barrier.SOURCE, arch)[:4] == b"\x7fELF"


def test_every_split_covers_the_ctas_and_fits_the_tiles(persistent_gemm):
    for split in persistent_gemm.SPLITS + persistent_gemm.LAYER:
        split.check()
    assert {s.name for s in persistent_gemm.SPLITS} == set(persistent_gemm.CUBLAS_US)
    with pytest.raises(AssertionError):
        persistent_gemm.Split("too wide", 1024, 4096, 128, 1024).check()
