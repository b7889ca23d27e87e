"""A protobuf fuzzer against a running worker. For every RPC hypothesis sends whole messages built field by field
from their descriptors, and valid requests with one or two fields set to an extreme (fuzz_values.py: float32 max,
subnormals, infinities, NaN, 2^31, 2^63, 2^64-1, negatives, empty and huge lists and maps), which get past the
first check far more often. After each example: the status is OK or documented (docs/api.md#errors), never
INTERNAL, UNKNOWN or a hang; health is SERVING; no sequence or KV block leaked; and a known sequence continues
exactly as its replay on the fresh worker did (tokens, logprobs, logits bytes)."""

import time

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from google.protobuf import text_format  # noqa: E402
from google.protobuf.descriptor import FieldDescriptor as F  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_values import build, is_map, message, mutate  # noqa: E402
from metrale.v1 import worker_pb2 as pb  # noqa: E402
from service_harness import start_worker  # noqa: E402
from steps_stub import StepError  # noqa: E402

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# RPC: (request type, whether the answer streams)
RPCS = {m.name: (m.input_type.name, m.server_streaming) for m in pb.DESCRIPTOR.services_by_name["Worker"].methods}
CALL_TIMEOUT = 30.0
MAX_REQUEST_BYTES = 3 << 20     # the test worker's max_message_mb is 4
SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING

SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 1, "repetition_penalty": 1.2,
           "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {9: 2.0}}
OUTPUT = {"logprobs": True, "top_logprobs": 3, "return_logits": True}
# Valid requests per RPC (sequences 1-3 are live while an example of WITH_LIVE_SEQUENCES runs, 2 sampled); the
# fuzzer sets one or two of their fields, or of the messages under them, to extremes. Each has a seed, so that its
# sampled tokens, and so hypothesis' verdict, do not change between runs.
VALID = {
    "Prefill": [{"slices": [{"seq_id": 11, "tokens": [5, 6, 7], "is_last_chunk": True, "sampling": {"seed": 3}}]},
                {"slices": [{"seq_id": 11, "tokens": [5, 6, 7], "is_last_chunk": True,
                             "sampling": {"temperature": 0.7, "seed": 1}}]},
                {"slices": [{"seq_id": 11, "tokens": [5, 6, 7, 8], "is_last_chunk": True, "sampling": SAMPLED,
                             "output": OUTPUT}]},
                {"slices": [{"seq_id": 11, "tokens": list(range(5, 25)), "is_last_chunk": True, "chunk_size": 6,
                             "sampling": {"temperature": 1.0, "seed": 2}},
                            {"seq_id": 12, "tokens": [9, 8], "is_last_chunk": True, "sampling": {"seed": 4},
                             "output": OUTPUT}]}],
    "Decode": [{"seq_ids": [1, 2], "tokens": [5, 6]}, {"seq_ids": [2], "tokens": [7]}],
    "MixedForward": [{"decode": {"seq_ids": [3], "tokens": [8]},
                      "prefill": {"slices": [{"seq_id": 12, "tokens": [5, 6], "is_last_chunk": True,
                                              "sampling": {"temperature": 0.7, "seed": 1}}]}},
                     {"decode": {"seq_ids": [1, 2], "tokens": [8, 9]},
                      "prefill": {"slices": [{"seq_id": 12, "tokens": [5, 6, 7], "is_last_chunk": True,
                                              "sampling": {"seed": 3}, "output": OUTPUT}]}},
                     {"decode": {"seq_ids": [2], "tokens": [8]},
                      "prefill": {"slices": [{"seq_id": 12, "tokens": [5, 6], "is_last_chunk": True,
                                              "sampling": SAMPLED, "output": OUTPUT}]}}],
    "BeamGenerate": [{"requests": [{"request_id": 1, "prompt_tokens": [5, 6, 7], "num_beams": 2,
                                    "max_new_tokens": 4}]},
                     {"requests": [{"request_id": 1, "prompt_tokens": [5, 6, 7], "num_beams": 1,
                                    "max_new_tokens": 4}]},
                     {"requests": [{"request_id": 1, "prompt_tokens": [5, 6, 7, 8], "num_beams": 3,
                                    "max_new_tokens": 5, "min_new_tokens": 2, "length_penalty": 0.6,
                                    "early_stopping": pb.EARLY_STOPPING_TRUE, "no_repeat_ngram_size": 2,
                                    "num_return_sequences": 2},
                                   {"request_id": 2, "prompt_tokens": [9], "num_beams": 2, "max_new_tokens": 3}]}],
    "Generate": [{"prompt_tokens": [5, 6, 7], "max_new_tokens": 4, "sampling": {"seed": 3}},
                 {"prompt_tokens": [5, 6, 7], "max_new_tokens": 4, "sampling": {"temperature": 0.7, "seed": 1}},
                 {"prompt_tokens": [5, 6, 7], "max_new_tokens": 5, "sampling": SAMPLED, "output": OUTPUT,
                  "stop_token_ids": [3]}],
    "Release": [{"seq_ids": [1, 2]}],
    "PrefillTailSplit": [{"tokens": list(range(5, 40))}],
    "NormalizeSsmStates": [{"seq_ids": [1]}],
    "Tokenize": [{"text": "hello world"}],
    "Detokenize": [{"tokens": [5, 6, 7]}],
    "Fork": [{"parent_seq_id": 2, "child_seq_ids": [21, 22]}, {"parent_seq_id": 3, "child_seq_ids": [21]}],
    "MatchPrefix": [{"tokens": list(range(5, 40))}, {"tokens": [4, 1], "cache_salt": "a"}],
}
# Steps: one channel carrying a Decode, Prefill or MixedForward of the above.
VALID["Steps"] = ([{"step_id": 1, "decode": r} for r in VALID["Decode"]]
                  + [{"step_id": 2, "prefill": r} for r in VALID["Prefill"][:2]]
                  + [{"step_id": 3, "mixed": r} for r in VALID["MixedForward"][:2]])
WITH_LIVE_SEQUENCES = {"Decode", "MixedForward", "Release", "NormalizeSsmStates", "Fork", "Steps"}
# Examples per RPC (others: 40): the file runs in ~60 s on two cores, most of it where requests reach the engine.
EXAMPLES = {"Prefill": 700, "Decode": 100, "MixedForward": 500, "BeamGenerate": 400, "Generate": 500}


class Shown:
    """A drawn request; in hypothesis' falsifying example, its one-line text format."""

    def __init__(self, request):
        self.request = request

    def __repr__(self) -> str:
        text = text_format.MessageToString(self.request, as_one_line=True)
        return f"{type(self.request).__name__}({text[:800]}{' ...' if len(text) > 800 else ''})"


@st.composite
def mutated(draw, rpc: str) -> Shown:
    """A valid request with one or two of its fields (at any depth) set to extremes."""
    request = build(getattr(pb, RPCS[rpc][0]), draw(st.sampled_from(VALID[rpc])))
    mutate(draw, request)
    assume(request.ByteSize() <= MAX_REQUEST_BYTES)
    return Shown(request)


@st.composite
def whole(draw, rpc: str) -> Shown:
    """A request built field by field from its descriptor."""
    cls = getattr(pb, RPCS[rpc][0])
    request = build(cls, draw(message(cls.DESCRIPTOR)))
    assume(request.ByteSize() <= MAX_REQUEST_BYTES)
    return Shown(request)


def requests_for(rpc: str) -> st.SearchStrategy:
    return st.one_of(mutated(rpc), mutated(rpc), mutated(rpc), whole(rpc)) if rpc in VALID else whole(rpc)


def seq_ids_in(request) -> set[int]:
    ids = set()
    for field, value in request.ListFields():
        if field.name in ("seq_id", "seq_ids", "parent_seq_id", "child_seq_ids"):
            ids.update(value if field.is_repeated else [value])
        elif field.type == F.TYPE_MESSAGE and not is_map(field):
            for sub in (value if field.is_repeated else [value]):
                ids |= seq_ids_in(sub)
    return ids


def comparable(reply: pb.ForwardResponse) -> bytes:
    """A one-sequence reply without its seq_id and times."""
    reply.seq_ids[:] = [0] * len(reply.seq_ids)
    for entry in list(reply.top_logprobs) + list(reply.logits):
        entry.seq_id = 0
    reply.forward_us = reply.queue_us = 0
    return reply.SerializeToString(deterministic=True)


KNOWN, REPLAYED = 4_000_000_001, 4_000_000_002    # ids no fuzzed request names
KNOWN_PROMPT = [5, 17, 99, 3, 42]
KNOWN_STEPS = 40


class FuzzedWorker:
    """A worker with a known sampled sequence that must continue as its replay on the fresh worker did. A worker an
    example left broken is replaced before the next, so hypothesis judges (and shrinks) each example on its own."""

    def __init__(self, directory):
        self.directory, self.worker, self.broken = directory, None, True

    def start(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        self.worker = start_worker(self.directory, max_model_len=64, max_batch_tokens=256, max_seqs=32, kv_blocks=48)
        self.stub, self.health = self.worker.stub, health_pb2_grpc.HealthStub(self.worker.channel)
        self.total = self.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_kv_blocks
        self.replay = self.run_known(REPLAYED, KNOWN_STEPS)
        self.stub.Release(pb.ReleaseRequest(seq_ids=[REPLAYED]), timeout=CALL_TIMEOUT)
        self.restart_known()

    def known_step(self, seq_id: int, token: int | None) -> pb.ForwardResponse:
        if token is None:
            slice_ = pb.PrefillSlice(seq_id=seq_id, tokens=KNOWN_PROMPT, is_last_chunk=True, output=OUTPUT)
            slice_.sampling.CopyFrom(build(pb.SamplingParams, {**SAMPLED, "seed": 77}))
            return self.stub.Prefill(pb.PrefillRequest(slices=[slice_]), timeout=CALL_TIMEOUT)
        return self.stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[token]), timeout=CALL_TIMEOUT)

    def run_known(self, seq_id: int, steps: int) -> list[tuple[bytes, int]]:
        token, outputs = None, []
        for _ in range(steps):
            reply = self.known_step(seq_id, token)
            token = reply.tokens[0]
            outputs.append((comparable(reply), token))
        return outputs

    def restart_known(self) -> None:
        self.stub.Release(pb.ReleaseRequest(seq_ids=[KNOWN]), timeout=CALL_TIMEOUT)
        self.position, self.token = 0, None
        self.continue_known()

    def continue_known(self) -> None:
        """One step of the known sequence, which must answer as the replay did; released at the replay's end."""
        if self.position == len(self.replay):
            self.restart_known()
            return
        output = comparable(self.known_step(KNOWN, self.token))
        assert output == self.replay[self.position][0], f"the known sequence's step {self.position} changed"
        self.token = self.replay[self.position][1]
        self.position += 1

    def settled_stats(self, expected: tuple[int, int], wait: float = 5.0) -> tuple[int, int]:
        """(free KV blocks, live sequences), once they are as expected or after `wait` s: Generate's sequence is
        released on its stream just after its last answer leaves."""
        deadline = time.monotonic() + wait
        while True:
            stats = self.worker.engine.stats()
            if (stats.free_kv_blocks, stats.live_sequences) == expected or time.monotonic() > deadline:
                return stats.free_kv_blocks, stats.live_sequences
            time.sleep(0.01)

    def prefill_live_sequences(self) -> None:
        """Sequences 1-3, which the valid requests of WITH_LIVE_SEQUENCES name."""
        slices = [pb.PrefillSlice(seq_id=1, tokens=[4, 1], is_last_chunk=True),
                  build(pb.PrefillSlice, {"seq_id": 2, "tokens": [4, 2], "is_last_chunk": True, "sampling": SAMPLED}),
                  pb.PrefillSlice(seq_id=3, tokens=[4, 3], is_last_chunk=True, output=OUTPUT)]
        self.stub.Prefill(pb.PrefillRequest(slices=slices), timeout=CALL_TIMEOUT)

    def call(self, rpc: str, request) -> tuple[grpc.StatusCode, str]:
        if rpc == "Steps":      # the step's status is its answer's error; the channel's own, an RpcError
            try:
                answers = list(self.stub.Steps(iter([request]), timeout=CALL_TIMEOUT))
            except grpc.RpcError as error:
                return error.code(), error.details()
            assert [a.step_id for a in answers] == [request.step_id], answers
            if not answers[0].HasField("error"):
                return grpc.StatusCode.OK, ""
            error = StepError(answers[0].error)
            return error.code(), error.details()
        try:
            reply = getattr(self.stub, rpc)(request, timeout=CALL_TIMEOUT)
            if RPCS[rpc][1]:
                list(reply)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details()

    def check(self, rpc: str, request) -> None:
        if self.broken:
            self.start()
        self.broken = True
        free = self.worker.engine.stats().free_kv_blocks
        if rpc in WITH_LIVE_SEQUENCES:
            self.prefill_live_sequences()
        code, details = self.call(rpc, request)
        assert code in DOCUMENTED, (code, details)
        status = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status
        assert status == SERVING, (code, details)
        released_all = rpc == "Release" and request.all
        ids = sorted((seq_ids_in(request) | {0, 1, 2, 3, 11, 12}) - {KNOWN})     # 0: an unset seq_id
        self.stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=CALL_TIMEOUT)
        expected = (self.total, 0) if released_all else (free, 1)
        assert self.settled_stats(expected) == expected, "a KV block or a sequence leaked"
        if released_all:
            self.restart_known()
        else:
            self.continue_known()
        self.broken = False


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir):
    worker = FuzzedWorker(tiny_model_dir)
    yield worker
    if worker.worker is not None:
        worker.worker.stop()


@pytest.mark.parametrize("rpc", list(RPCS))
def test_fuzzed_requests_leave_the_worker_serving(fuzzed, rpc):
    @settings(max_examples=EXAMPLES.get(rpc, 40), deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(requests_for(rpc))
    def check(shown):
        fuzzed.check(rpc, shown.request)

    check()
