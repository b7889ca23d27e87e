"""Fixtures for the CUDA kernel tests (marked gpu; skipped without a GPU): the kernel library, a stream, and the
linear tests' random weights."""

import pytest
import torch


@pytest.fixture(scope="session")
def cuda_device():
    from cuda.core import Device

    device = Device(0)
    device.set_current()
    return device


@pytest.fixture(scope="session")
def kernel_library(cuda_device, tmp_path_factory):
    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary

    return KernelLibrary(f"sm_{cuda_device.arch}a" if cuda_device.arch == "90" else f"sm_{cuda_device.arch}",
                         KernelCache(tmp_path_factory.mktemp("kernel-cache")))


@pytest.fixture
def stream(cuda_device):
    """A cuda.core stream; tests synchronize torch before a launch and this stream after it."""
    torch.cuda.synchronize()
    s = cuda_device.create_stream()
    yield s
    s.sync()
    s.close()


@pytest.fixture(scope="module")
def weights():
    """(N, K) -> bf16 weight [N, K], random, made once per shape."""
    made = {}

    def weight(n: int, k: int) -> torch.Tensor:
        if (n, k) not in made:
            generator = torch.Generator(device="cuda").manual_seed(n + 7 * k)
            made[n, k] = (torch.randn(n, k, generator=generator, device="cuda") / k ** 0.5).to(torch.bfloat16)
        return made[n, k]

    return weight
