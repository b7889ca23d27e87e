"""The persistent-kernel prototypes of bench/ (persistent_kernels.py, persistent_layer_kernel.py: measured before
anything is built on them) compile for Hopper and Ampere, with the layouts the host packs and splits the kernels can
run; no GPU needed (their figures and their checks against torch come from running them on the H200)."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.compiler import compile_cubin, with_headers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ["sm_90a", "sm_80"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.gpu_persistent_gemm
    import bench.gpu_persistent_layer
    import bench.persistent_kernels
    import bench.persistent_layer_kernel

    return bench


def test_headers_are_inlined_for_a_source_outside_the_kernel_folder(bench):
    source = with_headers(bench.persistent_kernels.GEMM_PHASES)
    assert "#include" not in source and source.count("__device__ __forceinline__ void mma_bf16(") == 1
    assert source.count("void grid_barrier(") == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_the_persistent_gemm_compiles(bench, arch):
    assert compile_cubin("persistent_gemm", with_headers(bench.persistent_kernels.GEMM_PHASES), arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_persistent_layer_compiles_with_the_layout_the_host_packs(bench, arch):
    """The kernel's static_assert holds Layer at LAYER_BYTES, which the host's record must match."""
    kernel = bench.persistent_layer_kernel
    assert np.dtype(kernel.LAYER_FIELDS).itemsize == kernel.LAYER_BYTES
    assert compile_cubin("persistent_layer", with_headers(kernel.DECODER_LAYERS), arch)[:4] == b"\x7fELF"
    for split in bench.gpu_persistent_layer.LINEARS:
        split.check()


@pytest.mark.parametrize("arch", ARCHS)
def test_both_grid_barriers_compile(bench, arch):
    assert compile_cubin("grid_barrier", bench.persistent_kernels.GRID_PHASES, arch)[:4] == b"\x7fELF"


def test_every_split_covers_the_ctas_and_fits_the_tiles(bench):
    gemm = bench.gpu_persistent_gemm
    for split in gemm.SPLITS + gemm.LAYER:
        split.check()
    assert {s.name for s in gemm.SPLITS} == set(gemm.CUBLAS_US)
    with pytest.raises(AssertionError):
        bench.persistent_kernels.Split("too wide", 1024, 4096, 128, 1024).check()


def test_the_l2_prefetch_stand_in_compiles_for_hopper(monkeypatch):
    """bench/gpu_l2_prefetch.py's kernel (cp.async.bulk.prefetch.L2 is sm_90's)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.gpu_l2_prefetch import SOURCE

    assert compile_cubin("stand_in", with_headers(SOURCE), "sm_90a")[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_pdl_linear_compiles(monkeypatch, arch):
    """bench/gpu_pdl_linear.py's kernel: the persistent prototype's split-K phase as a launch of its own."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.gpu_pdl_linear import SOURCE, SPLITS

    for split in SPLITS:
        split.check()
    assert compile_cubin("pdl_linear", with_headers(SOURCE), arch)[:4] == b"\x7fELF"


def test_the_fused_ffn_compiles_for_hopper_as_a_cluster_kernel(monkeypatch):
    """bench/gpu_fused_ffn.py's kernel (clusters and distributed shared memory are sm_90's): it asks for its
    clusters of FFN_Q CTAs itself, and its shared memory fits one CTA an SM."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.gpu_fused_ffn import D_MODEL, FFN, FFN_Q, PART, SOURCE, shared_bytes

    cubin = compile_cubin("fused_ffn", with_headers(SOURCE), "sm_90a")
    assert cubin[:4] == b"\x7fELF" and b"fused_ffn" in cubin
    assert FFN % PART == 0 and (D_MODEL // FFN_Q) % 32 == 0 and shared_bytes(D_MODEL) <= 227 * 1024
