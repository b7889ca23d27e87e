"""The Steps channel's own semantics, beside the API tests that run over it (steps_stub.py): pipelined steps on
one channel, errors that leave it open, answers per stream in order, step ids, and a cancelled channel's undo."""

import queue
import time

import grpc
import pytest

from metrale.v1 import worker_pb2 as pb

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8]


def open_channel(stub, **kw):
    requests = queue.SimpleQueue()
    return requests, stub.Steps(iter(requests.get, None), **kw)


def prefill(seq_id, tokens=PROMPT, **kw):
    return pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=tokens, is_last_chunk=True, **kw)])


@pytest.fixture
def stub(worker):
    yield worker.stub.stub       # the plain stub: these tests speak Steps themselves
    worker.stub.stub.Release(pb.ReleaseRequest(all=True))


def test_a_sequences_steps_sent_together_run_in_order(stub):
    """Prefill and three Decodes of one sequence sent at once (the decodes feed fixed tokens): each waits for the
    step before it, and the answers equal unary calls'."""
    requests, responses = open_channel(stub)
    requests.put(pb.StepRequest(step_id=10, prefill=prefill(1)))
    for i, token in enumerate([4, 9, 30]):
        requests.put(pb.StepRequest(step_id=11 + i, decode=pb.DecodeRequest(seq_ids=[1], tokens=[token])))
    requests.put(None)
    got = list(responses)
    assert [r.step_id for r in got] == [10, 11, 12, 13] and not any(r.HasField("error") for r in got)
    want = [stub.Prefill(prefill(2)).tokens[0]]
    want += [stub.Decode(pb.DecodeRequest(seq_ids=[2], tokens=[t])).tokens[0] for t in [4, 9, 30]]
    assert [r.result.tokens[0] for r in got] == want


def test_a_failed_step_answers_its_error_and_the_channel_goes_on(stub):
    requests, responses = open_channel(stub)
    requests.put(pb.StepRequest(step_id=1, prefill=prefill(1)))
    assert next(responses).result.seq_ids == [1]
    before = stub.Info(pb.InfoRequest())
    bad = [pb.StepRequest(step_id=2, decode=pb.DecodeRequest(seq_ids=[77], tokens=[1])),
           pb.StepRequest(step_id=3),
           pb.StepRequest(step_id=4, decode=pb.DecodeRequest(seq_ids=[1], tokens=[1 << 20])),
           pb.StepRequest(step_id=5, prefill=prefill(1)),
           pb.StepRequest(step_id=6, decode=pb.DecodeRequest(seq_ids=[1], tokens=[4], stream=9))]
    codes = []
    for request in bad:
        requests.put(request)
        response = next(responses)
        assert response.step_id == request.step_id and not response.HasField("result")
        codes.append(response.error.code)
    assert codes == [grpc.StatusCode.NOT_FOUND.value[0]] + [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 4
    after = stub.Info(pb.InfoRequest())
    assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)
    requests.put(pb.StepRequest(step_id=7, decode=pb.DecodeRequest(seq_ids=[1], tokens=[4])))
    ok = next(responses)
    assert ok.step_id == 7 and ok.result.seq_ids == [1]
    requests.put(None)
    assert list(responses) == []


def test_steps_on_two_streams_each_answer_in_order(stub):
    """A long chunked prefill on stream 0 and short steps on stream 1: stream 1's answers need not wait for stream
    0's, and each stream's come in the order sent."""
    requests, responses = open_channel(stub)
    long = pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[4] * 90, is_last_chunk=True, chunk_size=1)])
    requests.put(pb.StepRequest(step_id=1, prefill=long))
    for i in range(3):
        requests.put(pb.StepRequest(step_id=2 + i, prefill=pb.PrefillRequest(
            slices=[pb.PrefillSlice(seq_id=10 + i, tokens=PROMPT, is_last_chunk=True)], stream=1)))
    requests.put(None)
    order = [r.step_id for r in responses]
    assert sorted(order) == [1, 2, 3, 4] and [i for i in order if i > 1] == [2, 3, 4]
    assert order[-1] == 1


def assert_nothing_left(worker, stub, before, restore) -> None:
    """Once the worker has no step in flight (and restore() put the engine back), blocks and sequences are as
    before the channel."""
    deadline = time.monotonic() + 30
    while worker.server.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    restore()
    after = stub.Info(pb.InfoRequest())
    assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)


def test_a_cancelled_channel_undoes_its_step(worker, stub, monkeypatch):
    """The channel's deadline passes while its step runs: the step is undone as a cancelled unary call's is."""
    engine, step = worker.engine, worker.engine.step

    def slow(*args, **kwargs):
        time.sleep(0.6)
        return step(*args, **kwargs)

    before = stub.Info(pb.InfoRequest())
    monkeypatch.setattr(engine, "step", slow)
    requests, responses = open_channel(stub, timeout=0.3)
    requests.put(pb.StepRequest(step_id=1, prefill=prefill(5)))
    with pytest.raises(grpc.RpcError) as caught:
        next(responses)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_nothing_left(worker, stub, before, lambda: monkeypatch.setattr(engine, "step", step))
    assert stub.Prefill(prefill(5)).seq_ids == [5]        # the id is free: the step left nothing


def test_a_cancel_leaves_nothing_of_steps_waiting_behind_another(worker, stub, monkeypatch):
    """A decode waits for its sequence's slow prefill (stream 1); a prefill on the decode's stream (0) arrives after
    it and so waits too. The channel's deadline passes: all three are undone or never run, none is left half done."""
    engine, step = worker.engine, worker.engine.step
    slow = []

    def held(*args, **kwargs):
        if not slow:
            slow.append(1)
            time.sleep(0.8)
        return step(*args, **kwargs)

    before = stub.Info(pb.InfoRequest())
    monkeypatch.setattr(engine, "step", held)
    requests, responses = open_channel(stub, timeout=0.4)
    requests.put(pb.StepRequest(step_id=1, prefill=pb.PrefillRequest(
        slices=[pb.PrefillSlice(seq_id=100, tokens=PROMPT, is_last_chunk=True)], stream=1)))
    requests.put(pb.StepRequest(step_id=2, decode=pb.DecodeRequest(seq_ids=[100], tokens=[4])))
    requests.put(pb.StepRequest(step_id=3, prefill=prefill(200)))
    with pytest.raises(grpc.RpcError) as caught:
        list(responses)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_nothing_left(worker, stub, before, lambda: monkeypatch.setattr(engine, "step", step))
