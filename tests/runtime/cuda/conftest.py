"""Fixtures for the CUDA kernel tests (marked gpu; skipped without a GPU): the kernel library and a stream."""

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
