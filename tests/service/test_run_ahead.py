"""Decode run-ahead: a worker that runs each stream's guessed next decode step answers every request exactly as one
that does not, whether the guess is taken, undone for another token or batch, or in the way of a Release or of
a request that needs its KV block."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from metrale.v1 import worker_pb2 as pb
from service_harness import start_worker

SAMPLING = pb.SamplingParams(temperature=0.9, top_k=40, seed=7, repetition_penalty=1.1)
LOGPROBS = pb.OutputOptions(logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """Two workers on the same checkpoint: one runs ahead, one never does."""
    ahead = start_worker(tiny_model_dir, kv_blocks=12, max_model_len=192, num_streams=2, run_ahead="on")
    plain = start_worker(tiny_model_dir, kv_blocks=12, max_model_len=192, num_streams=2, run_ahead="off")
    yield ahead, plain
    for worker in (ahead, plain):
        worker.stop()


@pytest.fixture
def workers(pair):
    yield pair
    for worker in pair:
        worker.stub.Release(pb.ReleaseRequest(all=True))
        info = worker.stub.Info(pb.InfoRequest())
        assert info.free_kv_blocks == info.num_kv_blocks and info.live_sequences == 0


def both(workers, method: str, request):
    """Sends the request to both workers; returns the run-ahead worker's response after checking they agree."""
    responses = []
    for worker in workers:
        try:
            response = getattr(worker.stub, method)(request)
            if method != "Release":
                response.ClearField("forward_us")
                response.ClearField("queue_us")
            responses.append(response)
        except grpc.RpcError as error:
            responses.append((error.code(), error.details()))
    assert responses[0] == responses[1]
    return responses[0]


def start(workers, seq_ids, prompt_len=5, stream=0):
    slices = [pb.PrefillSlice(seq_id=i, tokens=[(i * 11 + j * 3) % 200 for j in range(prompt_len)],
                              is_last_chunk=True, sampling=SAMPLING, output=LOGPROBS) for i in seq_ids]
    return both(workers, "Prefill", pb.PrefillRequest(slices=slices, stream=stream))


def decode(workers, seq_ids, tokens, stream=0):
    return both(workers, "Decode", pb.DecodeRequest(seq_ids=seq_ids, tokens=tokens, stream=stream))


def counts(worker):
    return worker.engine.ahead_counts.taken, worker.engine.ahead_counts.undone


def test_taken_guesses_give_the_same_tokens(workers):
    ahead, _ = workers
    r = start(workers, [1, 2])
    taken_before, _ = counts(ahead)
    for _ in range(20):
        r = decode(workers, [1, 2], list(r.tokens))
    assert counts(ahead)[0] - taken_before == 19
    info = [w.stub.Info(pb.InfoRequest()) for w in workers]
    assert info[0].free_kv_blocks == info[1].free_kv_blocks


def test_another_token_or_batch_undoes_the_guess(workers):
    ahead, _ = workers
    r = start(workers, [1, 2, 3])
    r = decode(workers, [1, 2, 3], list(r.tokens))
    _, undone = counts(ahead)
    r = decode(workers, [1, 2, 3], [(t + 1) % 200 for t in r.tokens])     # not the sampled tokens
    r = decode(workers, [1, 3], [r.tokens[0], r.tokens[2]])               # one sequence dropped
    r = decode(workers, [3, 1], [r.tokens[1], r.tokens[0]])               # the same sequences, reordered
    decode(workers, [3, 1, 2], [r.tokens[0], r.tokens[1], 9])             # one added
    assert counts(ahead)[1] - undone == 4


def test_prefill_and_release_undo_guesses(workers):
    ahead, _ = workers
    r = start(workers, [1, 2])
    r = decode(workers, [1, 2], list(r.tokens))
    # A guess is pending on 1 and 2: a mixed step on them, then a Release of one of them.
    mixed = pb.MixedForwardRequest(decode=pb.DecodeRequest(seq_ids=[1, 2], tokens=list(r.tokens)),
                                   prefill=pb.PrefillRequest(slices=[pb.PrefillSlice(
                                       seq_id=5, tokens=[4, 5, 6], is_last_chunk=True, sampling=SAMPLING)]))
    both(workers, "MixedForward", mixed)
    r = decode(workers, [1, 2, 5], [3, 4, 5])
    both(workers, "Release", pb.ReleaseRequest(seq_ids=[2]))
    decode(workers, [1, 5], [r.tokens[0], r.tokens[2]])
    # A prefill for another stream, while guesses on stream 0 are pending.
    start(workers, [7], stream=1)


def test_a_guess_never_takes_a_block_a_request_needs(workers):
    ahead, plain = workers
    # 1 ends at 16 tokens, one full block: its guessed step takes a second block.
    r = start(workers, [1], prompt_len=15)
    r = decode(workers, [1], list(r.tokens))
    assert ahead.engine.cache.blocks.num_free == plain.engine.cache.blocks.num_free - 1
    assert ahead.stub.Info(pb.InfoRequest()).free_kv_blocks == plain.engine.cache.blocks.num_free == 11
    # 11 blocks for 2: only if the guess gives its block back.
    start(workers, [2], prompt_len=11 * 16)
    # And now 1 has no block for its 17th token on either worker: the same RESOURCE_EXHAUSTED.
    code, _ = decode(workers, [1], list(r.tokens))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_no_guess_past_max_model_len(workers):
    ahead, _ = workers
    r = start(workers, [1], prompt_len=190)
    r = decode(workers, [1], list(r.tokens))          # 191 tokens; the guess takes the 192nd
    r = decode(workers, [1], list(r.tokens))          # 192: a guess would pass max_model_len, none is made
    assert not ahead.engine.guesses._ahead
    code, _ = decode(workers, [1], list(r.tokens))
    assert code == grpc.StatusCode.OUT_OF_RANGE


def test_generate_runs_ahead(workers):
    ahead, _ = workers
    taken, _ = counts(ahead)
    request = pb.GenerateRequest(prompt_tokens=[5, 6, 7], max_new_tokens=12, sampling=SAMPLING)
    streamed = [[(m.token, m.index) for m in w.stub.Generate(request)] for w in workers]
    assert streamed[0] == streamed[1]
    assert counts(ahead)[0] > taken


def test_concurrent_clients_switching_streams(workers):
    """8 clients, each decoding its own sequence on alternating streams, so a guess made on one stream is met by
    a request on the other: the same tokens as one client after another on the plain worker."""
    ahead, plain = workers

    def drive(stub, seq_id):
        r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(
            seq_id=seq_id, tokens=[seq_id, 3, 5], is_last_chunk=True, sampling=SAMPLING, output=LOGPROBS)]))
        got = [(r.tokens[0], r.logprobs[0])]
        for step in range(10):
            r = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[got[-1][0]], stream=step % 2))
            got.append((r.tokens[0], r.logprobs[0]))
        return got

    ids = list(range(1, 9))
    sequential = {i: drive(plain.stub, i) for i in ids}
    with ThreadPoolExecutor(len(ids)) as pool:
        concurrent = dict(zip(ids, pool.map(lambda i: drive(ahead.stub, i), ids)))
    assert concurrent == sequential
