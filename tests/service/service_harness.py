"""Start an in-process worker on a loopback port, for the API tests."""

from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.service.config import WorkerConfig
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer
from steps_stub import ModeStub


def serve_checkpoint(checkpoint, config: WorkerConfig) -> InProcessWorker:
    """The worker, its stub's forward RPCs unary or over Steps as the test's step_rpc says (steps_stub.py)."""
    running = InProcessWorker(lambda: WorkerServer.from_checkpoint(checkpoint, config))
    running.stub = ModeStub(running.stub)
    return running


# The API tests' backend: "cpu" here; bench/gpu_check.sh runs them on "cuda" with --worker-device. Their workers'
# ranks: one, or --worker-tensor-parallel's.
WORKER_DEVICE = {"device": "cpu", "tensor_parallel": 1}


def start_worker(directory, metrics_port: int | None = None, worker: dict | None = None, **engine) -> InProcessWorker:
    """worker: more WorkerConfig fields (TLS, tokens); engine: EngineConfig fields."""
    config = WorkerConfig(host="127.0.0.1", port=0, drain_timeout=5.0, metrics_port=metrics_port,
                          engine=EngineConfig(device=WORKER_DEVICE["device"], **{"kv_blocks": 64, **engine}),
                          **{"max_message_mb": 4, "tensor_parallel": WORKER_DEVICE["tensor_parallel"],
                             **(worker or {})})
    return serve_checkpoint(load_checkpoint(directory), config)
