"""Prefill, Decode and MixedForward through a real gRPC channel: chunking, batching, the logits-row trap."""

import json

import numpy as np
import pytest

from metrale.v1 import worker_pb2 as pb
from service_harness import WORKER_DEVICE

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8, 150, 33, 61, 2, 90, 14, 77, 101, 12, 250, 4, 66, 31, 9, 180, 44, 71]
LOGITS = pb.OutputOptions(logprobs=True, return_logits=True)


def prefill(stub, seq_id, tokens, chunk_start=0, last=True, **kw):
    s = pb.PrefillSlice(seq_id=seq_id, tokens=tokens, chunk_start=chunk_start, is_last_chunk=last, output=LOGITS, **kw)
    return stub.Prefill(pb.PrefillRequest(slices=[s]))


def assert_same_logits(ours, expected):
    """Logits of one computation done two ways (chunked, batched, ...): equal up to summation order in float32
    on the CPU; within bf16 rounding (relative L2 error < 3e-2) on the CUDA backend, whose kernels differ
    between one-token and longer segments."""
    if WORKER_DEVICE["device"] == "cpu":
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-4)
    else:
        assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 3e-2


def logits_of(response, seq_id):
    return {m.seq_id: np.frombuffer(m.data, "<f4") for m in response.logits}[seq_id]


def decode_n(stub, seq_id, first_token, n):
    tokens, token = [], first_token
    for _ in range(n):
        r = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[token]))
        token = r.tokens[0]
        tokens.append(token)
    return tokens


def test_info(stub, worker, tiny_model_dir):
    info = stub.Info(pb.InfoRequest())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert info.architecture == config["architectures"][0]
    assert info.has_ssm == (config["model_type"] in ("mamba2", "nemotron_h", "falcon_h1", "granitemoehybrid"))
    assert info.vocab_size == 256 and info.kv_block_size == 16 and info.num_kv_blocks == 64
    assert info.free_kv_blocks == 64 and info.num_streams == 2 and info.max_model_len == 96
    assert info.is_mla == ("kv_lora_rank" in config) and not info.single_chunk_prefill
    assert info.supports_beam and info.eos_token_ids == [2]
    assert info.chat_template == ""         # the tiny checkpoints carry no tokenizer
    assert info.kv_dtype == info.dtype


@pytest.mark.parametrize("splits", [[25], [16, 9], [7, 11, 7], [1] * 25, [3, 13, 9]])
def test_chunked_prefill_equals_whole(stub, splits):
    whole = prefill(stub, 1, PROMPT)
    whole_next = decode_n(stub, 1, whole.tokens[0], 4)
    start = 0
    for i, n in enumerate(splits):
        r = prefill(stub, 2, PROMPT[start:start + n], chunk_start=start, last=i == len(splits) - 1)
        assert len(r.seq_ids) == (1 if i == len(splits) - 1 else 0)
        start += n
    assert_same_logits(logits_of(r, 2), logits_of(whole, 1))
    assert r.tokens[0] == whole.tokens[0]
    assert decode_n(stub, 2, r.tokens[0], 4) == whole_next


def test_chunk_size_split_by_worker_equals_whole(stub):
    whole = prefill(stub, 1, PROMPT)
    whole_next = decode_n(stub, 1, whole.tokens[0], 4)
    r = prefill(stub, 2, PROMPT, chunk_size=6)
    assert_same_logits(logits_of(r, 2), logits_of(whole, 1))
    assert decode_n(stub, 2, r.tokens[0], 4) == whole_next


def test_slices_finishing_in_different_rounds_with_decode_tokens(stub):
    """Slices with different chunk sizes finish in different forwards, next to decode tokens; every output is
    what the sequence gets alone, and the reply lists decode tokens then prompts in request order."""
    decoding_first = prefill(stub, 1, PROMPT[:7]).tokens[0]
    decoding_alone = stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[decoding_first]))
    stub.Release(pb.ReleaseRequest(seq_ids=[1]))
    prefill(stub, 1, PROMPT[:7])
    alone = {seq_id: prefill(stub, seq_id + 100, PROMPT[:n]) for seq_id, n in ((10, 25), (11, 7), (12, 13))}
    slices = [pb.PrefillSlice(seq_id=10, tokens=PROMPT, is_last_chunk=True, chunk_size=4, output=LOGITS),
              pb.PrefillSlice(seq_id=11, tokens=PROMPT[:7], is_last_chunk=True, output=LOGITS),
              pb.PrefillSlice(seq_id=12, tokens=PROMPT[:13], is_last_chunk=True, chunk_size=5, output=LOGITS)]
    mixed = stub.MixedForward(pb.MixedForwardRequest(decode=pb.DecodeRequest(seq_ids=[1], tokens=[decoding_first]),
                                                     prefill=pb.PrefillRequest(slices=slices)))
    assert list(mixed.seq_ids) == [1, 10, 11, 12]
    assert mixed.tokens[0] == decoding_alone.tokens[0]
    assert_same_logits(logits_of(mixed, 1), logits_of(decoding_alone, 1))
    for seq_id, r in alone.items():
        assert_same_logits(logits_of(mixed, seq_id), logits_of(r, seq_id + 100))


def test_batched_prefill_and_decode_equal_each_alone(stub):
    prompts = {10: PROMPT[:5], 11: PROMPT[3:20], 12: PROMPT}
    alone = {}
    for seq_id, tokens in prompts.items():  # a salt of their own: the batched prompts are computed, not cache hits
        r = prefill(stub, seq_id + 100, tokens, cache_salt="alone")
        alone[seq_id] = [(r.tokens[0], r.logprobs[0], logits_of(r, seq_id + 100))]
        for _ in range(5):
            r = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id + 100], tokens=[alone[seq_id][-1][0]]))
            alone[seq_id].append((r.tokens[0], r.logprobs[0], logits_of(r, seq_id + 100)))
    slices = [pb.PrefillSlice(seq_id=i, tokens=t, is_last_chunk=True, output=LOGITS) for i, t in prompts.items()]
    r = stub.Prefill(pb.PrefillRequest(slices=slices))
    got = {i: [(t, lp, logits_of(r, i))] for i, t, lp in zip(r.seq_ids, r.tokens, r.logprobs)}
    for _ in range(5):
        ids = sorted(got)
        r = stub.Decode(pb.DecodeRequest(seq_ids=ids, tokens=[got[i][-1][0] for i in ids]))
        assert list(r.seq_ids) == ids
        for i, t, lp in zip(r.seq_ids, r.tokens, r.logprobs):
            got[i].append((t, lp, logits_of(r, i)))
    for seq_id in prompts:
        for (token, logprob, row), (want_token, want_logprob, want_row) in zip(got[seq_id], alone[seq_id]):
            assert token == want_token and abs(logprob - want_logprob) < 1e-5
            assert_same_logits(row, want_row)


def test_finishing_prefill_never_leaks_into_decode_tokens(stub):
    """The logits-row trap: a prefill finishing in a mixed step must not change any decode token's output."""
    for seq_id in (1, 2, 3):
        prefill(stub, seq_id, PROMPT[seq_id:seq_id + 10])
    decode = pb.DecodeRequest(seq_ids=[1, 2, 3], tokens=[40, 41, 42])
    baseline = stub.Decode(decode)
    logits = {i: logits_of(baseline, i) for i in (1, 2, 3)}
    stub.Release(pb.ReleaseRequest(seq_ids=[1, 2, 3]))
    for seq_id in (1, 2, 3):
        prefill(stub, seq_id, PROMPT[seq_id:seq_id + 10])
    finishing = pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=9, tokens=PROMPT, is_last_chunk=True, output=LOGITS)])
    mixed = stub.MixedForward(pb.MixedForwardRequest(decode=decode, prefill=finishing))
    assert list(mixed.seq_ids) == [1, 2, 3, 9]
    assert list(mixed.tokens[:3]) == list(baseline.tokens)
    np.testing.assert_allclose(mixed.logprobs[:3], baseline.logprobs, rtol=0, atol=1e-5)
    for i in (1, 2, 3):
        assert_same_logits(logits_of(mixed, i), logits[i])
    alone = prefill(stub, 19, PROMPT)
    assert mixed.tokens[3] == alone.tokens[0]


def test_release_frees_every_block(stub):
    before = stub.Info(pb.InfoRequest()).free_kv_blocks
    prefill(stub, 1, PROMPT)
    prefill(stub, 2, PROMPT[:3])
    assert stub.Info(pb.InfoRequest()).free_kv_blocks == before - 3
    r = stub.Release(pb.ReleaseRequest(seq_ids=[1, 2, 77]))
    assert sorted(r.released_seq_ids) == [1, 2] and list(r.unknown_seq_ids) == [77] and r.blocks_freed == 3
    assert stub.Info(pb.InfoRequest()).free_kv_blocks == before
    again = stub.Release(pb.ReleaseRequest(seq_ids=[1, 2]))
    assert list(again.unknown_seq_ids) == [1, 2] and again.blocks_freed == 0


def test_seeded_sampling_ignores_batch_composition(stub):
    """The same seed gives the same tokens alone, in a batch with other sequences, and on another stream."""
    sampling = pb.SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def run(seq_id, others, stream):
        slices = [pb.PrefillSlice(seq_id=seq_id, tokens=PROMPT[:12], is_last_chunk=True, sampling=sampling)]
        slices += [pb.PrefillSlice(seq_id=o, tokens=PROMPT[o % 5:], is_last_chunk=True,
                                   sampling=pb.SamplingParams(temperature=1.0, seed=o)) for o in others]
        r = stub.Prefill(pb.PrefillRequest(slices=slices, stream=stream))
        last = dict(zip(r.seq_ids, r.tokens))
        tokens = [last[seq_id]]
        for _ in range(8):
            ids = [seq_id, *others]
            r = stub.Decode(pb.DecodeRequest(seq_ids=ids, tokens=[last[i] for i in ids], stream=stream))
            last = dict(zip(r.seq_ids, r.tokens))
            tokens.append(last[seq_id])
        return tokens

    alone = run(1, [], 0)
    assert run(2, [50, 51, 52], 1) == alone
    assert run(3, [60], 0) == alone
    assert len(set(alone)) > 2
