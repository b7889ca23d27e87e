"""A step that fails mid-way (device fault, cancellation, deadline) is undone: no sequence or block changes."""

import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.service import convert
from metrale.v1 import worker_pb2 as pb
from service_harness import start_worker

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8, 150, 33]
OUT = pb.OutputOptions(logprobs=True, return_logits=True)


@pytest.fixture
def faulty(tiny_model_dir):
    running = start_worker(tiny_model_dir, max_model_len=512, max_batch_tokens=512)
    yield running
    running.stop()


def make_pair(stub, seq_id):
    """seq_id and its twin seq_id + 100, both with a finished prompt, computed alike (each its own cache salt: the
    twin reuses no block)."""
    for i in (seq_id, seq_id + 100):
        r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=i, tokens=PROMPT, is_last_chunk=True,
                                                                   output=OUT, cache_salt=str(i))]))
    return r.tokens[0]


def assert_twins_agree(stub, seq_id, token):
    ours = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[token]))
    twin = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id + 100], tokens=[token]))
    assert ours.tokens == twin.tokens and ours.logits[0].data == twin.logits[0].data


def test_cancelled_step_is_undone(faulty):
    stub = faulty.stub
    token = make_pair(stub, 2)
    before = stub.Info(pb.InfoRequest())
    restores = []
    reservations = faulty.engine.reservations
    reservations.restore = lambda *args, restore=reservations.restore: (restore(*args), restores.append(1))
    # 500 one-token forwards (~0.6 s here) on a new sequence, decode token 2 in the first: longer than the deadline.
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


def test_a_step_cancelled_while_its_answer_is_built_is_undone(faulty, monkeypatch):
    """The cancel comes after the last forward, while the answer is being built: the step is undone all the same,
    and the call stays counted as in flight until its stream is done with it."""
    stub = faulty.stub
    token = make_pair(stub, 3)
    before = stub.Info(pb.InfoRequest())
    building, forward_response = [], convert.forward_response

    def slow(*args):
        building.append(1)
        time.sleep(3.0)
        return forward_response(*args)

    monkeypatch.setattr(convert, "forward_response", slow)
    with pytest.raises(grpc.RpcError) as caught:       # the deadline: past the forward (on a busy CI machine too)
        stub.Decode(pb.DecodeRequest(seq_ids=[3], tokens=[token]), timeout=1.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and building
    assert faulty.server.state.in_flight == 1        # its stream is still building the answer
    deadline = time.monotonic() + 30
    while faulty.server.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    monkeypatch.setattr(convert, "forward_response", forward_response)
    after = stub.Info(pb.InfoRequest())
    assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)
    assert_twins_agree(stub, 3, token)          # sequence 3 did not advance


def serving(worker) -> bool:
    health = health_pb2_grpc.HealthStub(worker.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker")).status
    return status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("sampling", [
    pb.SamplingParams(temperature=0.01, repetition_penalty=0.01, logit_bias={3: 100.0, 4: -100.0}, seed=1),
    pb.SamplingParams(temperature=100.0, repetition_penalty=100.0, presence_penalty=-2.0, frequency_penalty=2.0,
                      top_k=2**32 - 1, top_p=1.4e-45, min_p=1.0, seed=2**64 - 1),
])
def test_the_edges_of_every_sampling_range_sample(faulty, sampling):
    r = faulty.stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=7, tokens=PROMPT + [3], is_last_chunk=True,
                                                                       sampling=sampling, output=OUT)]))
    assert len(r.tokens) == 1 and serving(faulty)
    r = faulty.stub.Decode(pb.DecodeRequest(seq_ids=[7], tokens=[r.tokens[0]]))
    assert len(r.tokens) == 1 and serving(faulty)
    faulty.stub.Release(pb.ReleaseRequest(seq_ids=[7]))


BEAM = dict(request_id=1, prompt_tokens=PROMPT[:5], max_new_tokens=4)


@pytest.mark.parametrize("edges", [dict(num_beams=32, length_penalty=4.0, no_repeat_ngram_size=512),
                                   dict(num_beams=2, length_penalty=-4.0, no_repeat_ngram_size=1,
                                        num_return_sequences=2, early_stopping=pb.EARLY_STOPPING_NEVER)])
def test_the_edges_of_every_beam_range_search(faulty, edges):
    r = faulty.stub.BeamGenerate(pb.BeamGenerateRequest(requests=[pb.BeamRequest(**BEAM, **edges)]))
    hypotheses = r.results[0].hypotheses
    assert len(hypotheses) == edges.get("num_return_sequences", 1) and all(math.isfinite(h.score) for h in hypotheses)
    assert serving(faulty)
# The requests that had put a worker into its device-fault state for good (issue: fault isolation).
PAST_THE_RANGES = [
    ("Prefill", pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=8, tokens=PROMPT, is_last_chunk=True,
                                                          sampling=pb.SamplingParams(temperature=1e37, seed=1))])),
    ("Generate", pb.GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=2,
                                    sampling=pb.SamplingParams(temperature=1e37, seed=1))),
    ("BeamGenerate", pb.BeamGenerateRequest(requests=[pb.BeamRequest(num_beams=2, length_penalty=1100, **BEAM)])),
    ("BeamGenerate", pb.BeamGenerateRequest(requests=[pb.BeamRequest(num_beams=2, no_repeat_ngram_size=2**31,
                                                                     **BEAM)])),
    ("BeamGenerate", pb.BeamGenerateRequest(requests=[pb.BeamRequest(num_beams=1, no_repeat_ngram_size=2**31,
                                                                     **BEAM)])),
    ("Prefill", pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=8, tokens=PROMPT, is_last_chunk=True,
                                                          sampling=pb.SamplingParams(repetition_penalty=1e-45))])),
    ("Prefill", pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=8, tokens=PROMPT, is_last_chunk=True,
                                                          sampling=pb.SamplingParams(logit_bias={3: 3e38}))])),
]


@pytest.mark.parametrize("rpc, request_message", PAST_THE_RANGES, ids=lambda v: v if isinstance(v, str) else "")
def test_values_past_a_documented_range_are_refused_and_the_worker_serves_on(faulty, rpc, request_message):
    before = faulty.stub.Info(pb.InfoRequest())
    with pytest.raises(grpc.RpcError) as caught:
        result = getattr(faulty.stub, rpc)(request_message)
        if rpc == "Generate":
            list(result)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be" in caught.value.details()
    after = faulty.stub.Info(pb.InfoRequest())
    assert serving(faulty) and (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks,
                                                                                before.live_sequences)


def test_generate_on_a_missing_stream_and_release_of_reserved_ids(faulty):
    stub = faulty.stub
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(prompt_tokens=[1, 2], max_new_tokens=2, stream=5)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream 5" in caught.value.details()
    released = stub.Release(pb.ReleaseRequest(seq_ids=[1 << 63]))
    assert list(released.unknown_seq_ids) == [1 << 63] and not released.released_seq_ids
