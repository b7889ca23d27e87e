"""32 concurrent clients, each driving its own sequence, get exactly the tokens of a sequential run."""

from concurrent.futures import ThreadPoolExecutor

from metrale.v1 import worker_pb2 as pb

NUM_CLIENTS = 32
NUM_STEPS = 16


def drive(stub, seq_id: int) -> list[tuple[int, float]]:
    """Prefill an 8-token prompt, then decode NUM_STEPS tokens with seeded sampling."""
    prompt = [(seq_id * 7 + i * 13) % 256 for i in range(8)]
    sampling = pb.SamplingParams(temperature=0.8, top_k=50, seed=seq_id)
    output = pb.OutputOptions(logprobs=True)
    r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(
        seq_id=seq_id, tokens=prompt, is_last_chunk=True, sampling=sampling, output=output)], stream=seq_id % 2))
    got = [(r.tokens[0], r.logprobs[0])]
    for _ in range(NUM_STEPS - 1):
        r = stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[got[-1][0]], stream=seq_id % 2))
        got.append((r.tokens[0], r.logprobs[0]))
    return got


def test_concurrent_clients_match_a_sequential_run(stub):
    free = stub.Info(pb.InfoRequest()).free_kv_blocks
    ids = list(range(1, NUM_CLIENTS + 1))
    sequential = {i: drive(stub, i) for i in ids}
    stub.Release(pb.ReleaseRequest(seq_ids=ids))
    assert stub.Info(pb.InfoRequest()).free_kv_blocks == free

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        concurrent = dict(zip(ids, pool.map(lambda i: drive(stub, i), ids)))
    assert concurrent == sequential
    assert len({tuple(t for t, _ in v) for v in concurrent.values()}) > NUM_CLIENTS // 2
    released = stub.Release(pb.ReleaseRequest(all=True))
    assert sorted(released.released_seq_ids) == ids
    info = stub.Info(pb.InfoRequest())
    assert info.free_kv_blocks == free and info.live_sequences == 0
