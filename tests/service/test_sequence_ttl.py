"""--sequence-ttl: a sequence no step or Fork has used for that long is released (its blocks back in the pool, a later
step on it NOT_FOUND, counted in the metrics); one stepped within it, or any with the TTL off, is kept; Info says the
TTL and max_seqs."""

import time

import grpc
import pytest

from metrale.v1 import worker_pb2 as pb
from service_harness import start_worker
from test_metrics import free_port, scrape

TTL = 1.5      # seconds: long beside a step on a loaded 2-core machine, short beside a test
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def expiring(tiny_model_dir):
    port = free_port()
    running = start_worker(tiny_model_dir, kv_blocks=32, metrics_port=port, worker={"sequence_ttl": TTL})
    yield running.stub, port
    running.stop()


def prefill(stub, seq_id: int) -> int:
    return stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=PROMPT,
                                                                    is_last_chunk=True)])).tokens[0]


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_info_reports_the_ttl_and_max_seqs(expiring):
    stub, _ = expiring
    info = stub.Info(pb.InfoRequest())
    assert info.sequence_ttl_seconds == pytest.approx(TTL) and info.max_seqs > 0


def test_an_idle_sequence_is_released_and_a_stepped_one_kept(expiring):
    stub, port = expiring
    free = stub.Info(pb.InfoRequest()).free_kv_blocks
    expired_before = scrape(port).get(("metrale_sequences_expired_total", ()), 0.0)
    idle_token, busy_token = prefill(stub, 1), prefill(stub, 2)
    assert stub.Info(pb.InfoRequest()).free_kv_blocks < free
    # Sequence 2 is stepped every TTL / 4 for 2 TTLs; sequence 1 is left alone.
    deadline = time.monotonic() + 2 * TTL
    while time.monotonic() < deadline:
        busy_token = stub.Decode(pb.DecodeRequest(seq_ids=[2], tokens=[busy_token])).tokens[0]
        time.sleep(TTL / 4)
    with pytest.raises(grpc.RpcError) as error:
        stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[idle_token]))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Info(pb.InfoRequest()).live_sequences == 1
    assert scrape(port)[("metrale_sequences_expired_total", ())] == expired_before + 1
    # Once left alone, the other goes too, and every block comes back.
    assert wait_until(lambda: stub.Info(pb.InfoRequest()).live_sequences == 0, 3 * TTL)
    assert stub.Info(pb.InfoRequest()).free_kv_blocks == free


def test_a_forked_child_lives_a_ttl_from_its_fork(expiring):
    stub, _ = expiring
    token = prefill(stub, 5)
    time.sleep(TTL / 2)
    stub.Fork(pb.ForkRequest(parent_seq_id=5, child_seq_ids=[6]))
    time.sleep(TTL * 0.7)           # past the TTL from the prompt, within it from the fork
    out = stub.Decode(pb.DecodeRequest(seq_ids=[5, 6], tokens=[token, token]))
    assert list(out.seq_ids) == [5, 6]
    assert wait_until(lambda: stub.Info(pb.InfoRequest()).live_sequences == 0, 3 * TTL)


def test_no_ttl_keeps_every_sequence(tiny_model_dir):
    running = start_worker(tiny_model_dir, kv_blocks=32, worker={"sequence_ttl": 0})
    try:
        stub = running.stub
        assert stub.Info(pb.InfoRequest()).sequence_ttl_seconds == 0
        token = prefill(stub, 1)
        time.sleep(0.5)
        assert list(stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[token])).seq_ids) == [1]
    finally:
        running.stop()
