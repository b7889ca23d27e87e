"""Generate on a tiny model: the same tokens as Prefill + Decode, its limits, and clean-up on cancel."""

import time

import grpc
import pytest

from metrale.v1 import worker_pb2 as pb

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8]


def test_generate_equals_prefill_then_decode(stub):
    sampling = pb.SamplingParams(temperature=0.7, top_k=40, seed=99)
    streamed = list(stub.Generate(pb.GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=10, sampling=sampling,
                                                     ignore_eos=True, output=pb.OutputOptions(logprobs=True))))
    r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(
        seq_id=1, tokens=PROMPT, is_last_chunk=True, sampling=sampling, output=pb.OutputOptions(logprobs=True))]))
    stepped = [(r.tokens[0], r.logprobs[0])]
    for _ in range(9):
        r = stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[stepped[-1][0]]))
        stepped.append((r.tokens[0], r.logprobs[0]))
    assert [(m.token, m.logprob) for m in streamed] == stepped
    assert [m.index for m in streamed] == list(range(10)) and streamed[-1].finish_reason == "length"


def test_generate_stops_at_max_model_len(stub, worker):
    streamed = list(stub.Generate(pb.GenerateRequest(prompt_tokens=[4] * 90, max_new_tokens=50, ignore_eos=True)))
    # 90 prompt tokens + 6 generated = max_model_len 96 (the last generated token needs no KV).
    assert len(streamed) == 6 and streamed[-1].finish_reason == "length"
    assert stub.Info(pb.InfoRequest()).live_sequences == 0


def test_generate_rejects_bad_requests(stub):
    for request, code in [(pb.GenerateRequest(max_new_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
                          (pb.GenerateRequest(prompt_tokens=[1], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
                          (pb.GenerateRequest(prompt_tokens=[999], max_new_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
                          (pb.GenerateRequest(prompt="hi", max_new_tokens=3), grpc.StatusCode.FAILED_PRECONDITION)]:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request))
        assert caught.value.code() == code
    info = stub.Info(pb.InfoRequest())
    assert info.live_sequences == 0 and info.free_kv_blocks == info.num_kv_blocks


def test_cancelled_generate_releases_its_sequence(stub):
    call = stub.Generate(pb.GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=80, ignore_eos=True))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while stub.Info(pb.InfoRequest()).live_sequences and time.monotonic() < deadline:
        time.sleep(0.05)
    info = stub.Info(pb.InfoRequest())
    assert info.live_sequences == 0 and info.free_kv_blocks == info.num_kv_blocks
