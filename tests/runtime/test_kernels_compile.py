"""Every kernel compiles with NVRTC to cubin for Hopper, Ada and Ampere; no GPU needed."""

from importlib import resources

import pytest

from metrale.runtime.backend.cuda.compiler import KernelCache, compile_cubin, kernel_sources, with_headers

ARCHS = ("sm_90a", "sm_89", "sm_80")
SOURCES = kernel_sources()


def test_every_kernel_family_is_there():
    assert {"embedding", "norm", "activation", "rope_kv", "decode_attention", "decode_attention_mha",
            "prefill_attention", "sampling", "beam", "beam_step", "gemv", "ssm"} <= set(SOURCES)


def test_headers_are_pasted_in_once():
    # decode_attention.cu includes decode_attention.cuh, which includes attention_tiles.cuh, which includes
    # common.cuh: each appears once, no #include is left for NVRTC to resolve.
    source = SOURCES["decode_attention"]
    assert "#include" not in source
    assert source.count("__device__ __forceinline__ float bf16_to_float(") == 1
    assert source.count("struct Tile {") == 1 and source.count("struct DecodeArgs {") == 1


def test_a_source_from_outside_the_kernel_folder_gets_the_same_headers():
    # bench/kernel_variant.py compiles an edited copy of a package .cu, read from elsewhere, through with_headers.
    copy = (resources.files("metrale") / "cuda_kernels" / "decode_attention_mha.cu").read_text()
    assert with_headers(copy) == SOURCES["decode_attention_mha"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kernel_compiles_to_cubin(name, arch):
    cubin = compile_cubin(name, SOURCES[name], arch)
    assert cubin[:4] == b"\x7fELF"


def test_cache_compiles_once(tmp_path):
    name = sorted(SOURCES)[0]
    first = KernelCache(tmp_path).cubin(name, SOURCES[name], "sm_90a")
    cache = KernelCache(tmp_path)
    assert cache.cubin(name, SOURCES[name], "sm_90a") == first
    assert (cache.hits, cache.misses) == (1, 0)
    assert KernelCache(tmp_path).cubin(name, SOURCES[name] + "\n// changed\n", "sm_90a") != b""
    assert len(list(tmp_path.glob("*.cubin"))) == 2


def test_a_compile_error_carries_the_nvrtc_log():
    from metrale.runtime.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="undeclared_name"):
        compile_cubin("broken", 'extern "C" __global__ void k() { undeclared_name(); }', "sm_90a")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_hopper_prefill_launcher_gives_the_shared_memory_the_kernel_lays_out(head_dim):
    # The launcher's hopper_prefill_shared_bytes against HopperTiles<head_dim>::SHARED_BYTES, which NVRTC checks: the
    # source with a static_assert appended compiles only where the two agree.
    from metrale.runtime.backend.cuda.kernels.attention import hopper_prefill_shared_bytes
    from metrale.runtime.errors import FailedPrecondition

    source = SOURCES["prefill_attention_hopper"]
    shared = hopper_prefill_shared_bytes(head_dim)
    check = f"\nstatic_assert(HopperTiles<{head_dim}>::SHARED_BYTES == {{}}, \"shared bytes\");\n"
    assert compile_cubin("prefill_attention_hopper", source + check.format(shared), "sm_90a")[:4] == b"\x7fELF"
    with pytest.raises(FailedPrecondition, match="shared bytes"):
        compile_cubin("prefill_attention_hopper", source + check.format(shared + 16), "sm_90a")
