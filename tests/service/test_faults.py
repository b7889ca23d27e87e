"""A step that fails mid-way (device fault, cancellation, deadline) is undone: no sequence or block changes."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.v1 import worker_pb2 as pb
from service_harness import start_worker

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8, 150, 33]
OUT = pb.OutputOptions(logprobs=True, return_logits=True)


@pytest.fixture
def faulty(tiny_llama_dir):
    running = start_worker(tiny_llama_dir, max_model_len=512, max_batch_tokens=512)
    yield running
    running.stop()


def make_pair(stub, seq_id):
    """seq_id and its twin seq_id + 100, both with a finished prompt."""
    for i in (seq_id, seq_id + 100):
        r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=i, tokens=PROMPT, is_last_chunk=True,
                                                                   output=OUT)]))
    return r.tokens[0]


def assert_twins_agree(stub, seq_id, token):
    ours = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[token]))
    twin = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id + 100], tokens=[token]))
    assert ours.tokens == twin.tokens and ours.logits[0].data == twin.logits[0].data


def fail_on_call(model, n):
    """model.forward raises on its n-th call from now (1-based)."""
    forward, calls = model.forward, []

    def failing(*args):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected device fault")
        return forward(*args)
    model.forward = failing
    return lambda: setattr(model, "forward", forward)


def test_device_fault_in_a_later_round_undoes_the_whole_step(faulty):
    stub = faulty.stub
    token = make_pair(stub, 1)
    before = stub.Info(pb.InfoRequest())
    # Round 1: decode lane 1 + first chunk of new sequence 5; round 2 (fails): its second chunk.
    restore = fail_on_call(faulty.engine.model, 2)
    request = pb.MixedForwardRequest(decode=pb.DecodeRequest(seq_ids=[1], tokens=[token]), prefill=pb.PrefillRequest(
        slices=[pb.PrefillSlice(seq_id=5, tokens=[4] * 40, is_last_chunk=True, chunk_size=20)]))
    with pytest.raises(grpc.RpcError) as caught:
        stub.MixedForward(request)
    restore()
    assert caught.value.code() == grpc.StatusCode.INTERNAL and "injected device fault" in caught.value.details()
    after = stub.Info(pb.InfoRequest())
    assert after.free_kv_blocks == before.free_kv_blocks and after.live_sequences == before.live_sequences
    assert_twins_agree(stub, 1, token)
    health = health_pb2_grpc.HealthStub(faulty.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker")).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_cancelled_step_is_undone(faulty):
    stub = faulty.stub
    token = make_pair(stub, 2)
    before = stub.Info(pb.InfoRequest())
    restores = []
    engine = faulty.engine
    engine._restore = lambda *args, restore=engine._restore: (restore(*args), restores.append(1))
    # 500 one-token forwards (~0.6 s here) on a new sequence, decode lane 2 in the first: longer than the deadline.
    request = pb.MixedForwardRequest(decode=pb.DecodeRequest(seq_ids=[2], tokens=[token]), prefill=pb.PrefillRequest(
        slices=[pb.PrefillSlice(seq_id=6, tokens=[4] * 500, is_last_chunk=True, chunk_size=1)]))
    with pytest.raises(grpc.RpcError) as caught:
        stub.MixedForward(request, timeout=0.15)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while not restores and time.monotonic() < deadline:
        time.sleep(0.02)
    assert restores == [1], "the step was not undone by the engine"
    after = stub.Info(pb.InfoRequest())
    assert after.free_kv_blocks == before.free_kv_blocks and after.live_sequences == before.live_sequences
    # Sequence 2 is free again (its claim dropped) and exactly as before.
    assert_twins_agree(stub, 2, token)
    stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=6, tokens=[4], is_last_chunk=True)]))


def test_extreme_penalties_cannot_break_the_worker(faulty):
    stub = faulty.stub
    sampling = pb.SamplingParams(temperature=1.0, repetition_penalty=1e-45, logit_bias={3: 3e38, 4: 3e38}, seed=1)
    r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=7, tokens=PROMPT + [3], is_last_chunk=True,
                                                               sampling=sampling)]))
    assert len(r.tokens) == 1
    health = health_pb2_grpc.HealthStub(faulty.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker")).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_generate_on_a_missing_stream_and_release_of_reserved_ids(faulty):
    stub = faulty.stub
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(prompt_tokens=[1, 2], max_new_tokens=2, stream=5)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream 5" in caught.value.details()
    released = stub.Release(pb.ReleaseRequest(seq_ids=[1 << 63]))
    assert list(released.unknown_seq_ids) == [1 << 63] and not released.released_seq_ids
