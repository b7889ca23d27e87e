"""Every bad input of DESIGN.md §3: its status code, a clear message, and no state changed.

Sequences 1 and 2 are touched by the bad requests; 101 and 102 are their untouched twins (same prompt, same
seed). After each bad request both pairs decode, and their outputs must be identical, and the free-block
count must not have moved.
"""

import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from metrale.v1 import worker_pb2 as pb

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8, 150, 33, 61, 12, 90, 14, 77, 101, 12, 250]
SAMPLING = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
OUT = pb.OutputOptions(logprobs=True, return_logits=True)
TWINS = {1: 101, 2: 102}


def slice_(seq_id, tokens, chunk_start=0, last=True, **kw):
    """Each sequence its own cache salt: twins compute their prompts alike, neither reusing the other's blocks."""
    return pb.PrefillSlice(seq_id=seq_id, tokens=tokens, chunk_start=chunk_start, is_last_chunk=last,
                           cache_salt=str(seq_id), **kw)


@pytest.fixture
def live(stub):
    """1 (and 101): prompt finished, first token sampled. 2 (and 102): half a prompt."""
    for seq_id in (1, 101):
        first = stub.Prefill(pb.PrefillRequest(slices=[slice_(seq_id, PROMPT, sampling=SAMPLING, output=OUT)]))
    for seq_id in (2, 102):
        stub.Prefill(pb.PrefillRequest(slices=[slice_(seq_id, PROMPT[:9], last=False, sampling=SAMPLING, output=OUT)]))
    return first.tokens[0]


def assert_unchanged(stub, next_token, free_before, live_before):
    info = stub.Info(pb.InfoRequest())
    assert info.free_kv_blocks == free_before
    assert info.live_sequences == live_before
    ours = stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[next_token]))
    twin = stub.Decode(pb.DecodeRequest(seq_ids=[101], tokens=[next_token]))
    assert ours.tokens == twin.tokens and ours.logprobs == twin.logprobs
    assert ours.logits[0].data == twin.logits[0].data
    ours = stub.Prefill(pb.PrefillRequest(slices=[slice_(2, PROMPT[9:], chunk_start=9)]))
    twin = stub.Prefill(pb.PrefillRequest(slices=[slice_(102, PROMPT[9:], chunk_start=9)]))
    assert ours.tokens == twin.tokens and ours.logits[0].data == twin.logits[0].data


def expect(code, call, request, *words):
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    error = caught.value
    assert error.code() == code, error.details()
    for word in words:
        assert word in error.details(), error.details()
    return error


BAD_REQUESTS = {
    "empty tokens": ("Prefill", pb.PrefillRequest(slices=[slice_(1, [50], chunk_start=18 + 0), slice_(5, [])]),
                     grpc.StatusCode.INVALID_ARGUMENT, ["at least one token"]),
    "token id >= vocab (decode)": ("MixedForward", pb.MixedForwardRequest(
        decode=pb.DecodeRequest(seq_ids=[1], tokens=[256])), grpc.StatusCode.INVALID_ARGUMENT, ["256", "vocab_size"]),
    "token id >= vocab (prefill)": ("Prefill", pb.PrefillRequest(slices=[slice_(2, [3, 1000], chunk_start=9)]),
                                    grpc.StatusCode.INVALID_ARGUMENT, ["1000"]),
    "unknown seq id": ("Decode", pb.DecodeRequest(seq_ids=[1, 999], tokens=[4, 4]), grpc.StatusCode.NOT_FOUND,
                       ["999"]),
    "unknown seq id, continuing prefill": ("Prefill", pb.PrefillRequest(slices=[slice_(998, [4], chunk_start=5)]),
                                           grpc.StatusCode.NOT_FOUND, ["998"]),
    "duplicate seq id": ("Decode", pb.DecodeRequest(seq_ids=[1, 1], tokens=[4, 4]),
                         grpc.StatusCode.INVALID_ARGUMENT, ["more than once"]),
    "duplicate across decode and prefill": ("MixedForward", pb.MixedForwardRequest(
        decode=pb.DecodeRequest(seq_ids=[1], tokens=[4]),
        prefill=pb.PrefillRequest(slices=[slice_(1, [4], chunk_start=19)])),
        grpc.StatusCode.INVALID_ARGUMENT, ["more than once"]),
    "mismatched parallel arrays": ("Decode", pb.DecodeRequest(seq_ids=[1], tokens=[4, 5]),
                                   grpc.StatusCode.INVALID_ARGUMENT, ["parallel"]),
    "wrong chunk_start": ("Prefill", pb.PrefillRequest(slices=[slice_(2, [4], chunk_start=8)]),
                          grpc.StatusCode.INVALID_ARGUMENT, ["chunk_start=8", "holds 9"]),
    "chunk_start=0 on a live sequence": ("Prefill", pb.PrefillRequest(slices=[slice_(1, [4])]),
                                         grpc.StatusCode.INVALID_ARGUMENT, ["live"]),
    "decode before the last chunk": ("Decode", pb.DecodeRequest(seq_ids=[1, 2], tokens=[4, 4]),
                                     grpc.StatusCode.FAILED_PRECONDITION, ["seq_id 2", "not finished"]),
    "prefill after the prompt finished": ("Prefill", pb.PrefillRequest(slices=[slice_(1, [4], chunk_start=18)]),
                                          grpc.StatusCode.FAILED_PRECONDITION, ["Decode"]),
    "prompt past max_model_len": ("Prefill", pb.PrefillRequest(slices=[slice_(2, [4] * 88, chunk_start=9)]),
                                  grpc.StatusCode.OUT_OF_RANGE, ["max_model_len=96"]),
    "empty step": ("Decode", pb.DecodeRequest(), grpc.StatusCode.INVALID_ARGUMENT, ["empty"]),
    "no such stream": ("Decode", pb.DecodeRequest(seq_ids=[1], tokens=[4], stream=7),
                       grpc.StatusCode.INVALID_ARGUMENT, ["stream 7"]),
    "reserved seq id": ("Prefill", pb.PrefillRequest(slices=[slice_(1 << 63, [4])]),
                        grpc.StatusCode.INVALID_ARGUMENT, ["2^63"]),
    "over max_batch_tokens": ("MixedForward", pb.MixedForwardRequest(
        decode=pb.DecodeRequest(seq_ids=[1], tokens=[4]),
        # Over in every forward, wherever a state-space model's tail split cuts each prompt (at 80).
        prefill=pb.PrefillRequest(slices=[slice_(i, [4] * 90) for i in range(10, 17)])),
        grpc.StatusCode.RESOURCE_EXHAUSTED, ["max_batch_tokens=512"]),
}

BAD_SAMPLING = {
    "temperature": pb.SamplingParams(temperature=-0.5),
    "top_p": pb.SamplingParams(temperature=1.0, top_p=1.5),
    "min_p": pb.SamplingParams(min_p=2.0),
    "repetition_penalty": pb.SamplingParams(repetition_penalty=-1.0),
    "presence_penalty": pb.SamplingParams(presence_penalty=3.0),
    "frequency_penalty": pb.SamplingParams(frequency_penalty=-2.5),
    "logit_bias": pb.SamplingParams(logit_bias={300: 1.0}),
    "temperature nan": pb.SamplingParams(temperature=float("nan")),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_its_code_and_changes_nothing(stub, live, case):
    method, request, code, words = BAD_REQUESTS[case]
    info = stub.Info(pb.InfoRequest())
    expect(code, getattr(stub, method), request, *words)
    assert_unchanged(stub, live, info.free_kv_blocks, info.live_sequences)


@pytest.mark.parametrize("field", sorted(BAD_SAMPLING))
def test_out_of_range_sampling_is_rejected(stub, live, field):
    info = stub.Info(pb.InfoRequest())
    request = pb.MixedForwardRequest(decode=pb.DecodeRequest(seq_ids=[1], tokens=[4]), prefill=pb.PrefillRequest(
        slices=[slice_(7, [4, 5], sampling=BAD_SAMPLING[field])]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, stub.MixedForward, request, field.split()[0])
    assert_unchanged(stub, live, info.free_kv_blocks, info.live_sequences)


def test_too_many_top_logprobs_is_rejected(stub, live):
    info = stub.Info(pb.InfoRequest())
    request = pb.PrefillRequest(slices=[slice_(7, [4], output=pb.OutputOptions(top_logprobs=21))])
    expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Prefill, request, "top_logprobs")
    assert_unchanged(stub, live, info.free_kv_blocks, info.live_sequences)


def test_kv_exhaustion_reports_blocks_needed_and_free(stub, live):
    info = stub.Info(pb.InfoRequest())
    # 12 x 80 tokens in chunks of 40: under max_batch_tokens per forward, over the pool.
    slices = [slice_(20 + i, [4] * 80, chunk_size=40) for i in range(12)] + [slice_(2, PROMPT[9:], chunk_start=9)]
    error = expect(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Prefill, pb.PrefillRequest(slices=slices), "KV blocks")
    detail = error_details_pb2.ErrorInfo()
    status = rpc_status.from_call(error)
    assert status.details[0].Unpack(detail)
    assert detail.reason == "KV_BLOCKS_EXHAUSTED"
    assert int(detail.metadata["blocks_needed"]) == 12 * 5 + 1
    assert int(detail.metadata["blocks_free"]) == info.free_kv_blocks
    assert int(detail.metadata["blocks_needed"]) > int(detail.metadata["blocks_free"])
    assert_unchanged(stub, live, info.free_kv_blocks, info.live_sequences)


def test_decode_past_max_model_len(stub):
    stub.Prefill(pb.PrefillRequest(slices=[slice_(3, [4] * 96)]))
    before = stub.Info(pb.InfoRequest())
    expect(grpc.StatusCode.OUT_OF_RANGE, stub.Decode, pb.DecodeRequest(seq_ids=[3], tokens=[4]), "max_model_len")
    after = stub.Info(pb.InfoRequest())
    assert after.free_kv_blocks == before.free_kv_blocks


def test_message_over_size_limit(stub, live):
    info = stub.Info(pb.InfoRequest())
    huge = pb.PrefillRequest(slices=[slice_(8, [200] * (3 << 20))])   # ~6 MiB packed, limit 4 MiB
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Prefill, huge)
    assert_unchanged(stub, live, info.free_kv_blocks, info.live_sequences)


def test_second_concurrent_step_on_a_sequence_is_aborted(stub):
    # Sequence 40 is created by a slow step (90 one-token forwards); once Info shows it live, that step is
    # running and holds the sequence, so a step naming it on the other stream must be refused.
    slow = stub.Prefill.future(pb.PrefillRequest(slices=[slice_(40, [4] * 90, chunk_size=1)]))
    deadline = time.monotonic() + 30
    while stub.Info(pb.InfoRequest()).live_sequences == 0 and time.monotonic() < deadline:
        pass
    expect(grpc.StatusCode.ABORTED, stub.Prefill, pb.PrefillRequest(
        slices=[slice_(40, [4], chunk_start=90)], stream=1), "another step")
    first = slow.result()
    # The refused request changed nothing: the slow step's sequence continues as a fresh twin does.
    twin = stub.Prefill(pb.PrefillRequest(slices=[slice_(41, [4] * 90, output=OUT)]))
    assert first.tokens == twin.tokens
    ours = stub.Decode(pb.DecodeRequest(seq_ids=[40], tokens=[5]))
    theirs = stub.Decode(pb.DecodeRequest(seq_ids=[41], tokens=[5]))
    assert ours.tokens == theirs.tokens


def test_models_without_a_tokenizer_say_so(stub):
    expect(grpc.StatusCode.FAILED_PRECONDITION, stub.Tokenize, pb.TokenizeRequest(text="hi"), "tokenizer")
    expect(grpc.StatusCode.NOT_FOUND, stub.NormalizeSsmStates, pb.NormalizeSsmStatesRequest(seq_ids=[4242]), "4242")
    assert not stub.PrefillTailSplit(pb.PrefillTailSplitRequest(tokens=[1, 2, 3])).HasField("split")
