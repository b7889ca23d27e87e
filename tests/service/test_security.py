"""TLS, mutual TLS and bearer tokens against a real worker on loopback, with certificates made here: the right
credentials work; a client that trusts another CA, a plaintext client, a missing or foreign client certificate
cannot connect; a missing or wrong token gets UNAUTHENTICATED before the body is read, changes nothing and
floods no log; health stays open."""

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.runtime.errors import InvalidArgument
from metrale.service import security
from metrale.service.security import TokenAuthInterceptor, read_tokens, server_credentials
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc
from certificates import make_pki
from service_harness import start_worker
from worker_process import WorkerProcess, log_events

TOKENS = ("alpha-token-1f2e", "beta-token-9c8d")
GOOD = [("authorization", f"Bearer {TOKENS[1]}")]
ROUNDS, CONCURRENT = 3, 4         # unauthenticated large calls: rounds of concurrent calls


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# the gateways' tokens\n{TOKENS[0]}\n\n  {TOKENS[1]}  \n")
    return str(path)


@pytest.fixture(scope="module")
def tls_worker(tiny_model_dir, pki, tokens_file):
    worker = start_worker(tiny_model_dir, max_model_len=96, worker=dict(
        tls_cert=pki.files["server.crt"], tls_key=pki.files["server.key"], auth_tokens_file=tokens_file))
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def mtls_worker(tiny_model_dir, pki):
    worker = start_worker(tiny_model_dir, max_model_len=96, worker=dict(
        tls_cert=pki.files["server.crt"], tls_key=pki.files["server.key"], tls_client_ca=pki.files["ca.crt"]))
    yield worker
    worker.stop()


def prefill_body(count: int) -> bytes:
    """A serialized PrefillRequest of one slice of `count` tokens, each 1 (a byte of varint): written out directly,
    since building a message this big through protobuf would cost the test gigabytes."""
    head = pb.PrefillSlice(seq_id=1, is_last_chunk=True).SerializeToString()
    one_slice = head + b"\x12" + varint(count) + b"\x01" * count       # field 2 (tokens), packed
    return b"\x0a" + varint(len(one_slice)) + one_slice                 # field 1 (slices)


def varint(n: int) -> bytes:
    """n as protobuf's base-128 varint: 7 bits a byte, low first, the high bit set on all but the last."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def memory_kb(pid: int, field: str) -> int:
    """A line of /proc/<pid>/status in kB: VmRSS (resident now) or VmHWM (the peak since the last reset)."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith(f"{field}:")))


def reset_peak_memory_kb(pid: int) -> int:
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")                 # 5: VmHWM starts again from VmRSS (Linux 4.0+)
    return memory_kb(pid, "VmHWM")


def channel(worker, root: bytes, client=None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=client.key if client else None,
                                               certificate_chain=client.cert if client else None)
    return grpc.secure_channel(f"localhost:{worker.server.port}", credentials)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code()


def test_tls_with_a_token_serves(tls_worker, pki):
    with channel(tls_worker, pki.ca) as ch:
        info = worker_pb2_grpc.WorkerStub(ch).Info(pb.InfoRequest(), metadata=GOOD, timeout=10)
        assert info.vocab_size > 0
        first = [("authorization", f"Bearer {TOKENS[0]}")]
        assert worker_pb2_grpc.WorkerStub(ch).Info(pb.InfoRequest(), metadata=first, timeout=10).vocab_size > 0


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong-token")], [("authorization", TOKENS[0])],
                                      [("authorization", f"Bearer {TOKENS[0]}x")], [("authorization", "Bearer ")]])
def test_a_missing_or_wrong_token_is_unauthenticated(tls_worker, pki, metadata):
    with channel(tls_worker, pki.ca) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        assert code_of(lambda: stub.Info(pb.InfoRequest(), metadata=metadata, timeout=10)) == \
            grpc.StatusCode.UNAUTHENTICATED
        stream = stub.Generate(pb.GenerateRequest(prompt_tokens=[5, 6], max_new_tokens=2), metadata=metadata,
                               timeout=10)
        assert code_of(lambda: list(stream)) == grpc.StatusCode.UNAUTHENTICATED


def test_a_refused_call_changes_nothing_and_is_counted(tls_worker, pki):
    engine, metrics = tls_worker.engine, tls_worker.server.metrics
    before = engine.stats()
    refused = metrics.registry.get_sample_value("metrale_rpc_errors_total",
                                                {"rpc": "Prefill", "code": "UNAUTHENTICATED"}) or 0
    request = pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=7, tokens=[5, 6, 7], is_last_chunk=True)])
    with channel(tls_worker, pki.ca) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        bad = [("authorization", "Bearer nope")]
        assert code_of(lambda: stub.Prefill(request, metadata=bad, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        after = engine.stats()
        assert (after.live_sequences, after.free_kv_blocks) == (before.live_sequences, before.free_kv_blocks)
        assert metrics.registry.get_sample_value("metrale_rpc_errors_total",
                                                 {"rpc": "Prefill", "code": "UNAUTHENTICATED"}) == refused + 1
        stub.Prefill(request, metadata=GOOD, timeout=30)           # the same request, authorized, runs
        assert engine.stats().live_sequences == before.live_sequences + 1
        stub.Release(pb.ReleaseRequest(all=True), metadata=GOOD, timeout=10)


def test_health_needs_no_token(tls_worker, pki):
    with channel(tls_worker, pki.ca) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker"),
                                                     timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_client_that_trusts_another_ca_or_speaks_plaintext_cannot_connect(tls_worker, pki):
    with channel(tls_worker, pki.other_ca) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        assert code_of(lambda: stub.Info(pb.InfoRequest(), metadata=GOOD, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(f"localhost:{tls_worker.server.port}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        assert code_of(lambda: stub.Info(pb.InfoRequest(), metadata=GOOD, timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_takes_only_clients_the_ca_signed(mtls_worker, pki):
    with channel(mtls_worker, pki.ca, pki.client) as ch:
        assert worker_pb2_grpc.WorkerStub(ch).Info(pb.InfoRequest(), timeout=10).vocab_size > 0
    for client in (None, pki.stranger):
        with channel(mtls_worker, pki.ca, client) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert code_of(lambda: stub.Info(pb.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_bad_security_settings_are_refused(pki, tmp_path):
    with pytest.raises(InvalidArgument, match="go together"):
        server_credentials(pki.files["server.crt"], None, None)
    with pytest.raises(InvalidArgument, match="needs tls_cert"):
        server_credentials(None, None, pki.files["ca.crt"])
    with pytest.raises(InvalidArgument, match="cannot read"):
        server_credentials(str(tmp_path / "missing.crt"), pki.files["server.key"], None)
    empty = tmp_path / "tokens"
    empty.write_text("# none yet\n\n")
    with pytest.raises(InvalidArgument, match="no token"):
        read_tokens(str(empty))


def test_grpcurl_reaches_it_with_tls_and_a_token(tls_worker, pki):
    """The real grpcurl, as an operator debugs a deployed worker: reflection and a call over TLS with the token;
    without the token, UNAUTHENTICATED."""
    from test_grpcurl import grpcurl, json_messages

    address = f"localhost:{tls_worker.server.port}"
    flags = ("-cacert", pki.files["ca.crt"], "-H", f"authorization: Bearer {TOKENS[0]}")
    listed = grpcurl(address, "list", flags=flags, plaintext=False)
    assert "metrale.v1.Worker" in listed.stdout.split()
    (info,) = json_messages(grpcurl(address, "metrale.v1.Worker/Info", flags=flags, plaintext=False).stdout)
    assert int(info["vocab_size"]) > 0
    refused = grpcurl(address, "metrale.v1.Worker/Info", flags=("-cacert", pki.files["ca.crt"]), plaintext=False,
                      check=False)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr


def test_the_health_port_answers_probes_in_plaintext_and_serves_nothing_else(tiny_model_dir, pki):
    worker = start_worker(tiny_model_dir, max_model_len=96, worker=dict(
        tls_cert=pki.files["server.crt"], tls_key=pki.files["server.key"], health_port=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{worker.server.health_port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker"),
                                                         timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert code_of(lambda: stub.Info(pb.InfoRequest(), timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        worker.stop()


def test_malformed_bytes_without_a_token_are_unauthenticated(tls_worker, pki):
    """The refusal comes before the body is parsed: bytes that are no protobuf get UNAUTHENTICATED, not a parse
    error, on a unary and on a server-streaming method, and each refusal is counted."""
    metrics = tls_worker.server.metrics
    counted = lambda rpc: metrics.registry.get_sample_value("metrale_rpc_errors_total",
                                                            {"rpc": rpc, "code": "UNAUTHENTICATED"}) or 0
    before = {rpc: counted(rpc) for rpc in ("Prefill", "Generate")}
    with channel(tls_worker, pki.ca) as ch:
        prefill = ch.unary_unary("/metrale.v1.Worker/Prefill", request_serializer=None, response_deserializer=None)
        generate = ch.unary_stream("/metrale.v1.Worker/Generate", request_serializer=None,
                                   response_deserializer=None)
        garbage = b"\xff\xff\xff\xff not a protobuf"
        assert code_of(lambda: prefill(garbage, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: list(generate(garbage, timeout=10))) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: prefill(garbage, metadata=GOOD, timeout=10)) != grpc.StatusCode.UNAUTHENTICATED
    assert {rpc: counted(rpc) for rpc in before} == {rpc: n + 1 for rpc, n in before.items()}


def test_refusals_are_logged_as_one_line_per_interval(monkeypatch):
    """A flood of refused calls writes one line at once, then one line per log_every seconds with the refusals
    since the last line by method; every refusal still reaches the metrics' counter."""
    lines, counted = [], []
    monkeypatch.setattr(security, "log", SimpleNamespace(warning=lambda event, **fields: lines.append((event, fields))))
    interceptor = TokenAuthInterceptor([TOKENS[0].encode()], on_refused=counted.append, log_every=0.2)
    unary = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return unary

    def call(method, metadata=()):
        return interceptor.intercept_service(continuation, SimpleNamespace(method=method,
                                                                           invocation_metadata=metadata))

    async def flood():
        for i in range(40):
            handler = await call("/metrale.v1.Worker/Prefill" if i % 4 else "/metrale.v1.Worker/Decode")
            assert handler.request_streaming           # called before the request is read
        assert await call("/metrale.v1.Worker/Info", [("authorization", f"Bearer {TOKENS[0]}")]) is unary
        assert await call("/grpc.health.v1.Health/Check") is unary
        assert len(lines) == 1
        await asyncio.sleep(0.3)

    asyncio.run(flood())
    assert lines == [("unauthenticated", {"refused": {"/metrale.v1.Worker/Decode": 1}, "total": 1}),
                     ("unauthenticated", {"refused": {"/metrale.v1.Worker/Prefill": 30,
                                                      "/metrale.v1.Worker/Decode": 9}, "total": 39})]
    assert len(counted) == 40


def test_unauthenticated_large_calls_are_not_read(tiny_model_dir, tmp_path, tokens_file):
    """Concurrent unauthenticated calls of 181 MB each never take their bodies into the worker's memory, and
    leave it serving: a call with a token works after them, health stays SERVING, and the log holds no flood."""
    from test_load import scrape
    from test_metrics import free_port

    metrics_port = free_port()
    worker = WorkerProcess(tiny_model_dir, tmp_path / "worker.log", args=(
        "--max-message-mb", "200", "--auth-tokens-file", tokens_file, "--metrics-port", str(metrics_port))).start()
    try:
        assert list(pb.PrefillRequest.FromString(prefill_body(3)).slices[0].tokens) == [1, 1, 1]
        body = prefill_body(190_000_000)          # 181 MB: under the 200 MB limit, so only auth refuses
        prefill = worker.channel.unary_unary("/metrale.v1.Worker/Prefill", request_serializer=None,
                                             response_deserializer=None)
        codes = []
        before = reset_peak_memory_kb(worker.process.pid)
        for _ in range(ROUNDS):
            threads = [threading.Thread(target=lambda: codes.append(code_of(lambda: prefill(body, timeout=60))))
                       for _ in range(CONCURRENT)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        peak = memory_kb(worker.process.pid, "VmHWM")
        print(f"{ROUNDS}x{CONCURRENT} refused calls of {len(body) >> 20} MB: peak RSS {before >> 10} -> "
              f"{peak >> 10} MB")
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * (ROUNDS * CONCURRENT)
        # A body read is whole in memory (181 MB) and then parsed into 190 million tokens: one call with a token
        # grew RSS by 11 GB here. Unread, a call costs only the bytes HTTP/2 flow control let in before the answer,
        # plus what the allocator keeps, whatever the body's size: 9-47 MB over these 12 calls (122 MB once, on a
        # loaded CI machine).
        assert peak - before < 2 * len(body) >> 10, (before, peak)
        assert worker.stub.Info(pb.InfoRequest(), metadata=GOOD, timeout=10).vocab_size > 0
        assert worker.health_status() == health_pb2.HealthCheckResponse.SERVING
        refused = scrape(metrics_port)['metrale_rpc_errors_total{code="UNAUTHENTICATED",rpc="Prefill"}']
        assert refused == ROUNDS * CONCURRENT
        lines = [e for e in log_events(worker.log_path) if e.get("event") == "unauthenticated"]
        assert len(lines) <= 2, lines     # the first at once; the rest wait for the next line, 10 s on
    finally:
        worker.stop()
