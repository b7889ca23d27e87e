"""The reference gateway's tests: its package (examples/gateway) importable, and a tiny worker to drive."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gateway"))

from metrale.runtime.config import EngineConfig  # noqa: E402
from metrale.runtime.loading import load_checkpoint  # noqa: E402
from metrale.service.config import WorkerConfig  # noqa: E402
from metrale.service.in_process import InProcessWorker  # noqa: E402
from metrale.service.server import WorkerServer  # noqa: E402
from tiny_models import write_tiny  # noqa: E402


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A tiny random Llama on the CPU, 96 tokens a sequence at most, 64 blocks of 16."""
    checkpoint = load_checkpoint(write_tiny("llama_tied", tmp_path_factory.mktemp("tiny") / "llama"))
    config = WorkerConfig(host="127.0.0.1", port=0, drain_timeout=5.0,
                          engine=EngineConfig(device="cpu", kv_blocks=64, max_model_len=96, max_batch_tokens=256,
                                              max_seqs=32))
    running = InProcessWorker(lambda: WorkerServer.from_checkpoint(checkpoint, config))
    yield running
    running.stop()
