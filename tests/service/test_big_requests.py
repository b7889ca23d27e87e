"""Very large requests: the event loop stays free for health checks while they are worked on, text is bounded by
bytes before it is tokenized, lengths are checked before ids, and errors and log lines name a few offenders and
a count, never millions."""

import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.v1 import worker_pb2 as pb
from steps_stub import ModeStub
from worker_process import WorkerProcess, log_events

SENTENCE = "The capital of France is Paris, and the weather today is fine. "
MAX_TEXT_BYTES = 1 << 20


def health_gaps_while(worker, call) -> tuple[list[float], object]:
    """Runs call() on a thread and checks health every 10 ms while it runs; returns the gaps (seconds) between one
    answer and the next, which include any time this process's interpreter was held up too, and call's outcome
    (its result or its RpcError)."""
    outcome, done = {}, threading.Event()

    def run():
        try:
            outcome["value"] = call()
        except grpc.RpcError as error:
            outcome["value"] = error
        done.set()

    health = health_pb2_grpc.HealthStub(worker.channel)
    thread = threading.Thread(target=run)
    thread.start()
    gaps, last = [], time.perf_counter()
    while not done.wait(0.01):
        status = health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker"), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    return gaps, outcome["value"]


def assert_loop_was_free(gaps: list[float]) -> None:
    """Health answered all through the call: many answers, none held up for a large part of the call's time (a
    check run on the event loop shows one gap as long as the check). Relative, so a loaded machine cannot fail it."""
    assert len(gaps) >= 5, "the call ended before health was checked during it"
    assert max(gaps) < 0.5 * sum(gaps), gaps


def random_words(num_bytes: int) -> str:
    """Text of made-up words, which the tokenizer's word cache cannot shortcut: ~2 s a megabyte here."""
    rng = random.Random(0)
    words = ("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
             for _ in range(num_bytes))
    return " ".join(words)[:num_bytes]


def test_health_answers_while_a_megabyte_is_tokenized(default_worker):
    text = random_words(MAX_TEXT_BYTES)
    gaps, tokens = health_gaps_while(
        default_worker, lambda: default_worker.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120).tokens)
    assert len(tokens) > 100_000
    assert_loop_was_free(gaps)


def test_text_over_the_byte_limit_is_refused_before_tokenizing(default_worker):
    stub = default_worker.stub
    text = SENTENCE * (3 * MAX_TEXT_BYTES // len(SENTENCE))
    for call in (lambda: stub.Tokenize(pb.TokenizeRequest(text=text), timeout=5),
                 lambda: list(stub.Generate(pb.GenerateRequest(prompt=text, max_new_tokens=1), timeout=5))):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-text-bytes" in caught.value.details()
    # Multi-byte characters count as their UTF-8 bytes: 300,000 four-byte characters are over a mebibyte.
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(pb.TokenizeRequest(text="\U0001F600" * 300_000), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_prompt_past_max_model_len_is_refused_while_health_answers(default_worker):
    stub = default_worker.stub
    text = random_words(MAX_TEXT_BYTES)               # ~560,000 tokens; max_model_len is 8192
    gaps, error = health_gaps_while(
        default_worker, lambda: list(stub.Generate(pb.GenerateRequest(prompt=text, max_new_tokens=1), timeout=60)))
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert_loop_was_free(gaps)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[1] * 4_000_000,
                                                                is_last_chunk=True)]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE and "max_model_len" in caught.value.details()
    info = stub.Info(pb.InfoRequest())
    assert info.live_sequences == 0 and info.free_kv_blocks == info.num_kv_blocks


def test_a_million_unknown_ids_get_not_found_naming_a_few(default_worker):
    ids = [(1 << 62) + i for i in range(1_000_000)]
    gaps, error = health_gaps_while(
        default_worker, lambda: default_worker.stub.Decode(pb.DecodeRequest(seq_ids=ids, tokens=[1] * len(ids)),
                                                           timeout=60))
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND
    assert "(1000000 in all)" in error.details() and str(ids[0]) in error.details()
    assert len(error.details()) < 500
    assert_loop_was_free(gaps)


@pytest.fixture(scope="module")
def worker_process(tiny_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("big") / "worker.log"
    process = WorkerProcess(tiny_model_dir, log_path, args=("--kv-blocks", "32")).start()
    yield process
    process.stop()


def test_a_default_client_gets_not_found_and_the_log_lines_stay_short(worker_process):
    """A default client's metadata limit (8 KiB) is what had turned a long NOT_FOUND into RESOURCE_EXHAUSTED."""
    stub = ModeStub(worker_process.stub)
    logged = len(log_events(worker_process.log_path))      # the module's worker serves both runs of this test
    for count in (400, 200_000):
        ids = [(1 << 62) + 7 * i for i in range(count)]
        with pytest.raises(grpc.RpcError) as caught:
            stub.Decode(pb.DecodeRequest(seq_ids=ids, tokens=[1] * count), timeout=60)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
        released = stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)
        assert len(released.unknown_seq_ids) == count
    lines = worker_process.log_path.read_text().splitlines()
    failed = [e for e in log_events(worker_process.log_path)[logged:] if e.get("event") == "request_failed"]
    assert len(failed) == 2 and all(e["num_seqs"] == 400 or e["num_seqs"] == 200_000 for e in failed)
    assert max(len(line) for line in lines) < 2000


def test_health_answers_while_a_request_of_large_bias_maps_is_checked(default_worker):
    """60 slices, each with a logit_bias over the whole vocabulary: 26 MB of map entries to convert and check
    (seconds of Python), off the event loop."""
    bias = {i: 0.5 for i in range(49152)}
    slices = [pb.PrefillSlice(seq_id=100 + i, tokens=[1, 2, 3], is_last_chunk=True,
                              sampling=pb.SamplingParams(logit_bias=bias)) for i in range(60)]
    request = pb.PrefillRequest(slices=slices)
    gaps, outcome = health_gaps_while(default_worker, lambda: default_worker.stub.Prefill(request, timeout=120))
    assert not isinstance(outcome, grpc.RpcError) or outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert_loop_was_free(gaps)
    default_worker.stub.Release(pb.ReleaseRequest(all=True))
    info = default_worker.stub.Info(pb.InfoRequest())
    assert info.live_sequences == 0 and info.free_kv_blocks == info.num_kv_blocks
