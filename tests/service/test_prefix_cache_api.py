"""The prefix cache as a gateway sees it: ForwardResponse.cached_tokens, MatchPrefix (read-only, checked like any
request), Info's prefix_cache and cached_kv_blocks, and the prefix cache metrics."""

import grpc
import pytest

from metrale.v1 import worker_pb2 as pb

BLOCK = 16
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(2 * BLOCK + 5)]


def prefill(stub, seq_id, tokens, salt=""):
    return stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=tokens, is_last_chunk=True,
                                                                  cache_salt=salt)]))


def test_a_gateway_sees_what_the_cache_served(worker, stub, step_rpc):
    salt = step_rpc     # each run of the test its own cache (the module's worker serves both)
    registry = worker.server.metrics.registry
    hits = registry.get_sample_value("metrale_prefix_cache_lookups_total", {"result": "hit"})
    info = stub.Info(pb.InfoRequest())
    assert info.prefix_cache and info.kv_block_size == BLOCK
    assert stub.MatchPrefix(pb.MatchPrefixRequest(tokens=SYSTEM + [9], cache_salt=salt)).cached_tokens == 0
    first = prefill(stub, 1, SYSTEM + [9], salt)
    assert list(first.cached_tokens) == [0]
    assert stub.MatchPrefix(pb.MatchPrefixRequest(tokens=SYSTEM + [4, 4], cache_salt=salt)).cached_tokens == 2 * BLOCK
    assert stub.MatchPrefix(pb.MatchPrefixRequest(tokens=SYSTEM + [4], cache_salt="other")).cached_tokens == 0
    both = stub.Prefill(pb.PrefillRequest(slices=[
        pb.PrefillSlice(seq_id=2, tokens=SYSTEM + [4, 4], is_last_chunk=True, cache_salt=salt),
        pb.PrefillSlice(seq_id=3, tokens=[5, 6, 7], is_last_chunk=True, cache_salt=salt)]))
    assert list(both.seq_ids) == [2, 3] and list(both.cached_tokens) == [2 * BLOCK, 0]
    decoded = stub.Decode(pb.DecodeRequest(seq_ids=[2, 3], tokens=list(both.tokens)))
    assert list(decoded.cached_tokens) == [0, 0]
    stub.Release(pb.ReleaseRequest(all=True))
    after = stub.Info(pb.InfoRequest())
    assert after.free_kv_blocks == after.num_kv_blocks and after.cached_kv_blocks >= 2
    assert after.live_sequences == 0
    assert registry.get_sample_value("metrale_prefix_cache_lookups_total", {"result": "hit"}) == hits + 2
    assert registry.get_sample_value("metrale_prefix_cache_blocks") == after.cached_kv_blocks
    assert 0 < registry.get_sample_value("metrale_prefix_cache_hit_ratio") <= 1


@pytest.mark.parametrize("request_, code", [
    (pb.MatchPrefixRequest(tokens=[1] * 97), grpc.StatusCode.OUT_OF_RANGE),         # max_model_len is 96
    (pb.MatchPrefixRequest(tokens=[1, 1 << 20]), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_match_prefix_requests_get_their_code(stub, request_, code):
    with pytest.raises(grpc.RpcError) as caught:
        stub.MatchPrefix(request_)
    assert caught.value.code() == code


def test_an_empty_match_is_zero(stub):
    assert stub.MatchPrefix(pb.MatchPrefixRequest()).cached_tokens == 0


def test_the_documented_routing_loop_sends_a_prompt_to_the_worker_holding_its_prefix(tiny_model_dir):
    """docs/api.md's gateway loop, run as written over two workers: the second prompt with the first's system
    prompt goes where that prompt went and is served from its cache; the tokens are those of a cold worker."""
    import re
    from pathlib import Path

    from service_harness import start_worker

    page = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = page[page.index("## Prefix cache"):page.index("## BeamGenerate")]
    namespace = {}
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), namespace)
    workers = [start_worker(tiny_model_dir, max_model_len=96) for _ in range(2)]
    workers.append(start_worker(tiny_model_dir, max_model_len=96, prefix_cache=False))
    try:
        first, second, cold = (w.stub for w in workers)
        assert not cold.Info(pb.InfoRequest()).prefix_cache
        prompts = [SYSTEM + [9, 9], SYSTEM + [4, 2, 8]]
        prefill(second, 500, [1, 2, 3])        # the less loaded worker would otherwise win the first prompt's tie
        answers = namespace["serve"]([first, second], prompts, max_new_tokens=4)
        (stub_a, cached_a, tokens_a), (stub_b, cached_b, tokens_b) = answers
        assert stub_a is first and stub_b is first and (cached_a, cached_b) == (0, 2 * BLOCK)
        assert [tokens_a, tokens_b] == [tokens for _, _, tokens in namespace["serve"]([cold], prompts, 4)]
    finally:
        for worker in workers:
            worker.stop()


def test_fork_through_the_api(stub):
    first = prefill(stub, 1, SYSTEM)
    forked = stub.Fork(pb.ForkRequest(parent_seq_id=1, child_seq_ids=[2, 3]))
    assert list(forked.child_seq_ids) == [2, 3] and forked.blocks_shared == 2
    out = stub.Decode(pb.DecodeRequest(seq_ids=[1, 2, 3], tokens=[first.tokens[0]] * 3))
    assert len(set(out.tokens)) == 1            # greedy: the children continue as the parent does
    before = stub.Info(pb.InfoRequest())
    for request_, code in ((pb.ForkRequest(parent_seq_id=9, child_seq_ids=[10]), grpc.StatusCode.NOT_FOUND),
                           (pb.ForkRequest(parent_seq_id=1, child_seq_ids=[2]), grpc.StatusCode.INVALID_ARGUMENT),
                           (pb.ForkRequest(parent_seq_id=1, child_seq_ids=[1 << 63]),
                            grpc.StatusCode.INVALID_ARGUMENT),
                           (pb.ForkRequest(parent_seq_id=1, child_seq_ids=list(range(10, 200))),
                            grpc.StatusCode.RESOURCE_EXHAUSTED)):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Fork(request_)
        assert caught.value.code() == code, caught.value.details()
        after = stub.Info(pb.InfoRequest())
        assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)
