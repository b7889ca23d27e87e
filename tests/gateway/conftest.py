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


def start_worker(directory, num_streams: int = 1, dequantize: bool = False) -> InProcessWorker:
    """A worker of the checkpoint (a directory or a GGUF) on the CPU, 96 tokens a sequence at most, 64 blocks of
    16."""
    checkpoint = load_checkpoint(directory)
    config = WorkerConfig(host="127.0.0.1", port=0, drain_timeout=5.0,
                          engine=EngineConfig(device="cpu", kv_blocks=64, max_model_len=96, max_batch_tokens=256,
                                              max_seqs=32, num_streams=num_streams, dequantize=dequantize))
    return InProcessWorker(lambda: WorkerServer.from_checkpoint(checkpoint, config))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny("llama_tied", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def worker(tiny_dir):
    """A tiny random Llama on one stream."""
    running = start_worker(tiny_dir)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def default_worker(default_gguf):
    """The embedded default model (SmolLM2-135M with its tokenizer), for what needs text; dequantized to float32, so
    that batching changes its logits by ~1e-5 (the order of float32 sums), not by the ~0.1 the blocks path's bf16
    rounding can make of that, and a request's greedy text is the same alone or among 32."""
    running = start_worker(default_gguf, dequantize=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def workers(tiny_dir):
    """Two workers of the same tiny model, two streams each."""
    running = [start_worker(tiny_dir, num_streams=2) for _ in range(2)]
    yield running
    for worker in running:
        worker.stop()
