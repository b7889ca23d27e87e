"""A real worker on a loopback port, serving a tiny random Llama, for the API tests."""

import pytest

from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.service.config import WorkerConfig
from metrale.v1 import worker_pb2
from service_harness import WORKER_DEVICE, serve_checkpoint, start_worker
from steps_stub import STEP_RPC
from tiny_models import write_tiny


# Modules whose tests run twice: the forward RPCs as unary calls, and over the Steps channel (steps_stub.py).
STEP_RPC_MODULES = {"test_forward_api", "test_errors", "test_concurrency", "test_faults", "test_fault_isolation",
                    "test_limits", "test_prefix_cache_api", "test_run_ahead", "test_metrics", "test_big_requests"}


def pytest_generate_tests(metafunc):
    if "step_rpc" in metafunc.fixturenames and metafunc.module.__name__.rsplit(".", 1)[-1] in STEP_RPC_MODULES:
        metafunc.parametrize("step_rpc", ["unary", "steps"], indirect=True)


@pytest.fixture(autouse=True)
def step_rpc(request):
    STEP_RPC["mode"] = getattr(request, "param", "unary")
    yield STEP_RPC["mode"]
    STEP_RPC["mode"] = "unary"


@pytest.fixture(scope="session", autouse=True)
def worker_device(request):
    WORKER_DEVICE["device"] = request.config.getoption("--worker-device")
    WORKER_DEVICE["tensor_parallel"] = request.config.getoption("--worker-tensor-parallel")
    return WORKER_DEVICE["device"]


@pytest.fixture(scope="session")
def tiny_model_dir(request, tmp_path_factory):
    """The API tests' model: a tiny random Llama, or the architecture --worker-model names."""
    name = request.config.getoption("--worker-model")
    return write_tiny(name, tmp_path_factory.mktemp("tiny") / name)


@pytest.fixture(scope="module")
def default_worker(default_gguf):
    """The embedded default model (SmolLM2-135M, with its GGUF tokenizer) on the CPU, default message limits."""
    config = WorkerConfig(host="127.0.0.1", port=0, engine=EngineConfig(device="cpu", kv_blocks=128))
    running = serve_checkpoint(load_checkpoint(default_gguf), config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    running = start_worker(tiny_model_dir, max_model_len=96, max_batch_tokens=512, num_streams=2)
    yield running
    running.stop()


@pytest.fixture
def stub(worker):
    yield worker.stub
    # Every test leaves the worker empty for the next.
    worker.stub.Release(worker_pb2.ReleaseRequest(all=True))
