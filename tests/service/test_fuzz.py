"""A protobuf fuzzer against a running worker: hypothesis builds request messages field by field from their
descriptors (ids near the vocabulary and far past it, negative-looking uint64s, NaN and infinite floats, empty and
long lists, unknown enum values), sends each to its RPC, and checks the answer: OK or a documented status
(docs/api.md#errors), never INTERNAL, UNKNOWN or a hang; then the worker still answers and no KV block leaked."""

import math

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from google.protobuf.descriptor import FieldDescriptor as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from metrale.v1 import worker_pb2 as pb  # noqa: E402
from metrale.v1 import worker_pb2_grpc  # noqa: E402
from service_harness import start_worker  # noqa: E402

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# (RPC, request type, whether the answer streams)
RPCS = [(m.name, m.input_type.name, m.server_streaming)
        for m in pb.DESCRIPTOR.services_by_name["Worker"].methods]
CALL_TIMEOUT = 60.0

INTS = st.one_of(st.integers(0, 300), st.integers(0, 5), st.sampled_from([255, 256, 2**31 - 1, 2**31, 2**32 - 1]))
INT64S = st.one_of(INTS, st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]))
FLOATS = st.one_of(st.floats(-2.0, 2.0), st.sampled_from([0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e30]))


def scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return INTS.filter(lambda v: 0 <= v < 2**32)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return INT64S.filter(lambda v: 0 <= v < 2**64)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.one_of(INTS.filter(lambda v: v < 2**31), st.integers(-(2**31), -1))
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return INT64S.filter(lambda v: -(2**63) <= v < 2**63)
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return FLOATS
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.text(max_size=40)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 50))
    raise AssertionError(f"no strategy for field type {t}")


def message(descriptor, depth: int = 0) -> st.SearchStrategy:
    """A dict of field values for a message (unset fields left out), nested messages to depth 3."""
    parts = {}
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            parts[field.name] = st.dictionaries(scalar(key), scalar(value), max_size=6)
            continue
        if field.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            value = message(field.message_type, depth + 1)
        else:
            value = scalar(field)
        if field.is_repeated:
            value = st.lists(value, max_size=6 if field.type == F.TYPE_MESSAGE else 24)
        parts[field.name] = value
    return st.fixed_dictionaries({}, optional=parts)


def build(cls, values: dict):
    out = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        if isinstance(value, dict) and field.is_repeated:      # a map field
            getattr(out, name).update(value)
        elif field.type == F.TYPE_MESSAGE:
            sub = field.message_type._concrete_class
            if field.is_repeated:
                getattr(out, name).extend(build(sub, v) for v in value)
            else:
                getattr(out, name).CopyFrom(build(sub, value))
        elif field.is_repeated:
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out


@pytest.fixture(scope="module")
def fuzzed(tiny_llama_dir):
    worker = start_worker(tiny_llama_dir, max_model_len=64, max_batch_tokens=256, max_seqs=32, kv_blocks=48)
    yield worker
    worker.stop()


# A valid request per RPC that works on state: the fuzzer also varies these field by field, so most examples get
# past the first check and reach the engine (sequences 1-3 are live while each example runs).
VALID = {
    "Prefill": {"slices": [{"seq_id": 11, "tokens": [5, 6, 7], "is_last_chunk": True}]},
    "Decode": {"seq_ids": [1, 2], "tokens": [5, 6]},
    "MixedForward": {"decode": {"seq_ids": [3], "tokens": [8]},
                     "prefill": {"slices": [{"seq_id": 12, "tokens": [5, 6], "is_last_chunk": True}]}},
    "BeamGenerate": {"requests": [{"request_id": 1, "prompt_tokens": [5, 6, 7], "num_beams": 2,
                                   "max_new_tokens": 4}]},
    "Generate": {"prompt_tokens": [5, 6, 7], "max_new_tokens": 4},
    "NormalizeSsmStates": {"seq_ids": [1]},
}


def near(base: dict, descriptor) -> st.SearchStrategy:
    """base with each field kept or given a fuzzed value, list elements varied alike, and any other field added."""
    parts = {}
    for name, value in base.items():
        field = descriptor.fields_by_name[name]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            parts[name] = st.lists(near(value[0], field.message_type), min_size=1, max_size=3)
        elif isinstance(value, dict):
            parts[name] = near(value, field.message_type)
        elif isinstance(value, list):
            parts[name] = st.one_of(st.just(value), st.lists(scalar(field), max_size=24))
        else:
            parts[name] = st.one_of(st.just(value), scalar(field))
    extra = message(descriptor)
    return st.builds(lambda kept, added: {**added, **kept}, st.fixed_dictionaries(parts), extra)


def requests_for(rpc: str) -> st.SearchStrategy:
    name = next(r[1] for r in RPCS if r[0] == rpc)
    descriptor = pb.DESCRIPTOR.message_types_by_name[name]
    if rpc in VALID:
        return st.one_of(near(VALID[rpc], descriptor), message(descriptor))
    return message(descriptor)


@pytest.mark.parametrize("rpc", [r[0] for r in RPCS])
def test_fuzzed_requests_get_documented_answers(fuzzed, rpc):
    stub = worker_pb2_grpc.WorkerStub(fuzzed.channel)
    request_name, streaming = next((r[1], r[2]) for r in RPCS if r[0] == rpc)
    cls = getattr(pb, request_name)
    method = getattr(stub, rpc)
    total = fuzzed.engine.stats().num_kv_blocks

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(requests_for(rpc))
    def check(values):
        request = build(cls, values)
        stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=i, tokens=[4, i], is_last_chunk=True)
                                               for i in (1, 2, 3)]), timeout=CALL_TIMEOUT)
        try:
            reply = method(request, timeout=CALL_TIMEOUT)
            if streaming:
                list(reply)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
        assert code in DOCUMENTED, (rpc, str(request)[:400], code)
        stub.Release(pb.ReleaseRequest(all=True), timeout=CALL_TIMEOUT)
        assert fuzzed.engine.stats().free_kv_blocks == total

    check()
    assert stub.Info(pb.InfoRequest(), timeout=10).num_kv_blocks == total
