"""SIGTERM and SIGINT on a worker subprocess: in-flight streams finish, new work gets UNAVAILABLE,
health turns NOT_SERVING, and the process exits 0 within the drain timeout."""

import json
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from metrale.v1 import worker_pb2 as pb
from tiny_models import write_tiny
from worker_process import WorkerProcess, log_events

# The tiny Llama with a longer context: its weights do not depend on the position (RoPE), so raising
# max_position_embeddings lets one Generate run ~1000 steps, a few seconds on a CPU.
MAX_MODEL_LEN = 2048
LONG_GENERATE = pb.GenerateRequest(prompt_tokens=[5, 17, 99, 3, 42], max_new_tokens=1000, ignore_eos=True)
DRAIN_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    directory = write_tiny("llama_tied", tmp_path_factory.mktemp("shutdown") / "llama")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    config_path.write_text(json.dumps(config))
    return directory


def start(model, tmp_path, drain_timeout: float) -> WorkerProcess:
    args = ("--kv-blocks", "160", "--max-model-len", str(MAX_MODEL_LEN), "--drain-timeout", str(drain_timeout))
    return WorkerProcess(model, tmp_path / "worker.log", args=args).start()


def wait_for_health(worker: WorkerProcess, status: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while worker.health_status() != status:
        assert time.monotonic() < deadline, f"health did not turn {status}:\n{worker.log_tail()}"
        time.sleep(0.01)


def one_slice_prefill(seq_id: int) -> pb.PrefillRequest:
    return pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=[1, 2, 3], is_last_chunk=True)])


def test_sigterm_lets_a_long_generate_finish_and_refuses_new_work(long_context_model, tmp_path):
    worker = start(long_context_model, tmp_path, DRAIN_TIMEOUT)
    try:
        stub = worker.stub
        expected = [r.token for r in stub.Generate(LONG_GENERATE)]
        assert len(expected) == LONG_GENERATE.max_new_tokens

        stream = stub.Generate(LONG_GENERATE)
        first = next(stream)
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)

        # The servicer sets draining before health changes, so once NOT_SERVING is seen, draining is on.
        wait_for_health(worker, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert worker.health_status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(one_slice_prefill(1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused_generate:
            list(stub.Generate(pb.GenerateRequest(prompt_tokens=[1, 2], max_new_tokens=2), timeout=10))
        assert refused_generate.value.code() == grpc.StatusCode.UNAVAILABLE

        responses = [first, *stream]
        assert [r.token for r in responses] == expected
        assert [r.index for r in responses] == list(range(LONG_GENERATE.max_new_tokens))
        assert responses[-1].finish_reason == "length"

        assert worker.wait(DRAIN_TIMEOUT) == 0, worker.log_tail()
        assert time.monotonic() - signalled < DRAIN_TIMEOUT
    finally:
        worker.stop()
    events = [e["event"] for e in log_events(worker.log_path)]
    draining = [e for e in log_events(worker.log_path) if e["event"] == "draining"]
    # The Generate was still in flight when draining began, and drain did not have to give up on it.
    assert [e["in_flight"] for e in draining] == [1]
    assert "drain_timeout" not in events and events[-1] == "stopped"


def test_sigint_past_the_drain_timeout_cuts_the_stream_and_exits(long_context_model, tmp_path):
    drain_timeout = 0.2
    worker = start(long_context_model, tmp_path, drain_timeout)
    # ~2040 steps take seconds; drain gives up after drain_timeout plus the server's 1 s grace.
    longest = pb.GenerateRequest(prompt_tokens=[5, 17, 99], max_new_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)
    try:
        stream = worker.stub.Generate(longest)
        received = [next(stream)]
        signalled = time.monotonic()
        worker.send_signal(signal.SIGINT)
        with pytest.raises(grpc.RpcError) as cut:
            received.extend(stream)
        # Cut by the server's stop: UNAVAILABLE, so a gateway retries the request on another worker.
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(received) < longest.max_new_tokens
        # drain_timeout, then the server's 1 s grace for the RPCs it cancels, then the exit.
        assert worker.wait(drain_timeout + 5) == 0, worker.log_tail()
        assert time.monotonic() - signalled < drain_timeout + 1 + 3
    finally:
        worker.stop()
    assert "drain_timeout" in [e["event"] for e in log_events(worker.log_path)]
