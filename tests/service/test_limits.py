"""The server's limits: forward calls in flight at once (one more gets RESOURCE_EXHAUSTED and changes nothing, while
control calls still get through), answers over the message size (refused or undone), and the keepalive and
message-size options its port is built with."""

import threading

import grpc
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.service.config import WorkerConfig
from metrale.service.server import server_options
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc
from service_harness import WORKER_DEVICE, start_worker


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    worker = start_worker(tiny_model_dir, max_model_len=96, worker=dict(max_concurrent_rpcs=1))
    yield worker
    worker.stop()


def test_one_rpc_over_the_limit_is_resource_exhausted(limited, monkeypatch):
    engine = limited.engine
    entered, release = threading.Event(), threading.Event()
    step = engine.step

    def held(*args, **kwargs):          # the first Prefill holds its RPC open on the stream
        entered.set()
        release.wait(30)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", held)
    with grpc.insecure_channel(limited.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        first = stub.Prefill.future(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[5, 6, 7],
                                                                               is_last_chunk=True)]), timeout=60)
        assert entered.wait(30)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=2, tokens=[5], is_last_chunk=True)]),
                         timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert first.result().seq_ids == [1]
        monkeypatch.setattr(engine, "step", step)
        assert engine.stats().live_sequences == 1          # the refused one created nothing
        stub.Release(pb.ReleaseRequest(all=True), timeout=10)


def test_the_port_gets_the_configured_keepalive_and_message_limits():
    options = dict(server_options(WorkerConfig(max_message_mb=8, keepalive_time=30, keepalive_timeout=5,
                                               keepalive_min_client_ping=2)))
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 8 << 20
    assert options["grpc.keepalive_time_ms"] == 30000 and options["grpc.keepalive_timeout_ms"] == 5000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 2000


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    """A tiny Llama whose logits row is 65536 float32s, 256 KiB: four rows alone fill a 1 MiB message."""
    config = transformers.LlamaConfig(vocab_size=65536, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("wide") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def one_mb(wide_vocab_dir):
    worker = start_worker(wide_vocab_dir, max_model_len=64, worker=dict(max_message_mb=1))
    yield worker
    worker.stop()


def test_a_step_past_the_lists_region_is_refused_and_changes_nothing(wide_vocab_dir):
    """60 rows, each biasing all 65536 ids: on the CUDA backend 23.6M words of per-row lists, past the 16.8M its
    region holds; the step is undone with RESOURCE_EXHAUSTED (it had been a device fault). The CPU has no such
    region and samples them."""
    worker = start_worker(wide_vocab_dir, max_model_len=64, kv_blocks=128, worker=dict(max_message_mb=64))
    try:
        bias = {i: 0.5 for i in range(65536)}
        slices = [pb.PrefillSlice(seq_id=i + 1, tokens=[1, 2, 3], is_last_chunk=True,
                                  sampling=pb.SamplingParams(logit_bias=bias)) for i in range(60)]
        try:
            worker.stub.Prefill(pb.PrefillRequest(slices=slices), timeout=300)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
            assert "lists region" in error.details()
        cuda = WORKER_DEVICE["device"] == "cuda"
        assert code == (grpc.StatusCode.RESOURCE_EXHAUSTED if cuda else grpc.StatusCode.OK)
        health = health_pb2_grpc.HealthStub(worker.channel)
        check = health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker"), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        info = worker.stub.Info(pb.InfoRequest())
        assert info.live_sequences == (60 if code == grpc.StatusCode.OK else 0)
    finally:
        worker.stop()


LOGITS = pb.OutputOptions(return_logits=True)
PROMPT = [5, 17, 99, 3]


def prefill_with_logits(stub, seq_ids):
    slices = [pb.PrefillSlice(seq_id=i, tokens=PROMPT, is_last_chunk=True, output=LOGITS) for i in seq_ids]
    return stub.Prefill(pb.PrefillRequest(slices=slices))


def steps_run(engine, monkeypatch) -> list:
    calls, step = [], engine.step
    monkeypatch.setattr(engine, "step", lambda *args, **kwargs: (calls.append(1), step(*args, **kwargs))[1])
    return calls


@pytest.mark.parametrize("rows, runs", [(4, True), (5, False)], ids=["edge-rolled-back", "refused-before"])
def test_a_decode_answer_over_the_message_limit_is_refused_and_changes_nothing(one_mb, monkeypatch, rows, runs):
    """4 rows: the logits alone are exactly the limit, the whole answer just over it: run, then undone. 5 rows: the
    logits alone pass it: refused before running."""
    stub = one_mb.stub
    ids = list(range(1, rows + 2))              # the last one is the twin that stays out of the refused step
    for group in (ids[:3], ids[3:]):
        token = prefill_with_logits(stub, group).tokens[0]
    before = stub.Info(pb.InfoRequest())
    calls = steps_run(one_mb.engine, monkeypatch)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Decode(pb.DecodeRequest(seq_ids=ids[:rows], tokens=[token] * rows))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-message-mb" in caught.value.details()
    assert bool(calls) == runs
    after = stub.Info(pb.InfoRequest())
    assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)
    # No sequence advanced: the first decodes exactly as its twin, which the refused step never touched.
    ours = stub.Decode(pb.DecodeRequest(seq_ids=[ids[0]], tokens=[token]))
    twin = stub.Decode(pb.DecodeRequest(seq_ids=[ids[-1]], tokens=[token]))
    assert ours.logits[0].data == twin.logits[0].data
    three = stub.Decode(pb.DecodeRequest(seq_ids=ids[1:4], tokens=[token] * 3))       # under the limit: answered
    assert len(three.logits) == 3
    stub.Release(pb.ReleaseRequest(all=True))


@pytest.mark.parametrize("rows, runs", [(4, True), (5, False)], ids=["edge-rolled-back", "refused-before"])
def test_a_prefill_answer_over_the_message_limit_leaves_no_sequence(one_mb, monkeypatch, rows, runs):
    stub = one_mb.stub
    before = stub.Info(pb.InfoRequest())
    calls = steps_run(one_mb.engine, monkeypatch)
    with pytest.raises(grpc.RpcError) as caught:
        prefill_with_logits(stub, range(1, rows + 1))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and bool(calls) == runs
    after = stub.Info(pb.InfoRequest())
    assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences) \
        and after.live_sequences == 0
    monkeypatch.undo()
    assert len(prefill_with_logits(stub, range(1, 4)).logits) == 3       # a retry in parts: no "is live"
    stub.Release(pb.ReleaseRequest(all=True))


@pytest.fixture
def two_in_flight(tiny_model_dir, monkeypatch):
    """A worker allowing two forward calls at once, with two Prefills held open on their streams."""
    worker = start_worker(tiny_model_dir, max_model_len=96, num_streams=2, worker=dict(max_concurrent_rpcs=2))
    engine, step = worker.engine, worker.engine.step
    entered, release = threading.Semaphore(0), threading.Event()

    def held(*args, **kwargs):
        entered.release()
        release.wait(30)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", held)
    futures = [worker.stub.Prefill.future(pb.PrefillRequest(
        slices=[pb.PrefillSlice(seq_id=i, tokens=[5, 6, 7], is_last_chunk=True)], stream=i - 1), timeout=60)
        for i in (1, 2)]
    assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
    yield worker
    release.set()
    assert [f.result().seq_ids for f in futures] == [[1], [2]]
    worker.stop()


def test_control_calls_get_through_while_the_forward_limit_is_reached(two_in_flight):
    stub = two_in_flight.stub
    with pytest.raises(grpc.RpcError) as caught:
        stub.Decode(pb.DecodeRequest(seq_ids=[9], tokens=[1]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-concurrent-rpcs" in caught.value.details()
    health = health_pb2_grpc.HealthStub(two_in_flight.channel)
    check = health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker"), timeout=5)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert stub.Info(pb.InfoRequest(), timeout=5).free_kv_blocks == 64     # the held steps have not planned yet
    assert list(stub.Release(pb.ReleaseRequest(seq_ids=[77]), timeout=5).unknown_seq_ids) == [77]
    assert list(stub.PrefillTailSplit(pb.PrefillTailSplitRequest(tokens=[1, 2]), timeout=5).ListFields()) == []


def test_health_watch_streams_on_the_main_port(worker):
    health = health_pb2_grpc.HealthStub(worker.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service="metrale.v1.Worker"), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
