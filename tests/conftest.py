"""Shared test fixtures: the embedded default model's GGUF, and the gpu marker that skips without CUDA."""

from pathlib import Path

import pytest

from metrale.runtime.default_model import default_cache_dir, fetch_default_model


def pytest_addoption(parser):
    parser.addoption("--worker-device", default="cpu", choices=("cpu", "cuda"),
                     help="backend of the in-process workers of the API tests")
    parser.addoption("--worker-model", default="llama_tied",
                     help="the tiny architecture (tests/tiny_models.py) the API tests' workers serve")
    parser.addoption("--worker-tensor-parallel", default=1, type=int,
                     help="ranks the API tests' workers split their model over (serve --tensor-parallel)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped where torch.cuda.is_available() is False")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF, downloaded once into the user cache (~/.cache/metrale)."""
    return fetch_default_model(default_cache_dir())
