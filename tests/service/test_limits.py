"""The server's limits: RPCs in flight at once (one more gets RESOURCE_EXHAUSTED and changes nothing), and the
keepalive and message-size options its port is built with."""

import threading

import grpc
import pytest

from metrale.service.config import WorkerConfig
from metrale.service.server import server_options
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc
from service_harness import start_worker


@pytest.fixture(scope="module")
def limited(tiny_llama_dir):
    worker = start_worker(tiny_llama_dir, max_model_len=96, worker=dict(max_concurrent_rpcs=1))
    yield worker
    worker.stop()


def test_one_rpc_over_the_limit_is_resource_exhausted(limited, monkeypatch):
    engine = limited.engine
    entered, release = threading.Event(), threading.Event()
    step = engine.step

    def held(*args, **kwargs):          # the first Prefill holds its RPC open on the device lane
        entered.set()
        release.wait(30)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", held)
    with grpc.insecure_channel(limited.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        first = stub.Prefill.future(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[5, 6, 7],
                                                                               is_last_chunk=True)]), timeout=60)
        assert entered.wait(30)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=2, tokens=[5], is_last_chunk=True)]),
                         timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert first.result().seq_ids == [1]
        monkeypatch.setattr(engine, "step", step)
        assert engine.stats().live_sequences == 1          # the refused one created nothing
        stub.Release(pb.ReleaseRequest(all=True), timeout=10)


def test_the_port_gets_the_configured_keepalive_and_message_limits():
    options = dict(server_options(WorkerConfig(max_message_mb=8, keepalive_time=30, keepalive_timeout=5,
                                               keepalive_min_client_ping=2)))
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 8 << 20
    assert options["grpc.keepalive_time_ms"] == 30000 and options["grpc.keepalive_timeout_ms"] == 5000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 2000
