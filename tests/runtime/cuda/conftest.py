"""Fixtures for the CUDA tests (marked gpu; skipped without a GPU): the kernel library and a stream for the kernel
tests; a tiny M2M100 and a tiny Llama on a CUDA engine, each with transformers' float32 and bf16 models of the same
checkpoint, for the model and beam tests (one per test module)."""

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
def m2m100(tmp_path_factory):
    import transformers

    from cuda_engines import WEIGHTS, with_references
    from tiny_models import write_tiny_m2m100

    directory = write_tiny_m2m100(tmp_path_factory.mktemp("m2m100") / "m2m100", **WEIGHTS)
    return with_references(directory, tmp_path_factory.mktemp("m2m100-cache"),
                           transformers.M2M100ForConditionalGeneration.from_pretrained)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import transformers

    from cuda_engines import WEIGHTS, with_references
    from tiny_models import write_tiny

    directory = write_tiny("llama_tied", tmp_path_factory.mktemp("beam-llama") / "llama", **WEIGHTS)
    return with_references(directory, tmp_path_factory.mktemp("llama-cache"),
                           transformers.AutoModelForCausalLM.from_pretrained)
