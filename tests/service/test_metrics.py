"""The Prometheus endpoint, scraped over HTTP, moves with what the client did."""

import socket
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.v1 import worker_pb2 as pb
from service_harness import start_worker
from steps_stub import rpc_name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def metered(tiny_model_dir):
    port = free_port()
    running = start_worker(tiny_model_dir, kv_blocks=32, metrics_port=port)
    yield running, port
    running.stop()


def test_metrics_follow_the_requests(metered):
    worker, port = metered
    stub = worker.stub
    decode_rpc = rpc_name("Decode")
    seconds, errors = (("metrale_rpc_seconds_count", (("rpc", decode_rpc),)),
                       ("metrale_rpc_errors_total", (("code", "NOT_FOUND"), ("rpc", decode_rpc))))
    prefill_tokens, decode_tokens = (("metrale_tokens_total", (("kind", "prefill"),)),
                                     ("metrale_tokens_total", (("kind", "decode"),)))
    before = scrape(port)       # the module's worker serves the unary run and the Steps run of this test
    stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[3] * 20, is_last_chunk=True),
                                           pb.PrefillSlice(seq_id=2, tokens=[4] * 5, is_last_chunk=True)]))
    for _ in range(3):
        stub.Decode(pb.DecodeRequest(seq_ids=[1, 2], tokens=[7, 7]))
    with pytest.raises(grpc.RpcError):
        stub.Decode(pb.DecodeRequest(seq_ids=[9], tokens=[7]))
    m = scrape(port)
    moved = lambda key: m.get(key, 0) - before.get(key, 0)
    assert moved(prefill_tokens) == 25 and moved(decode_tokens) == 6
    assert moved(errors) == 1
    assert moved(seconds) == (4 if decode_rpc == "Decode" else 5)     # Steps: the Prefill's step too
    assert m[("metrale_live_sequences", ())] == 2
    assert m[("metrale_kv_blocks_used", ())] == 3 and m[("metrale_kv_blocks_free", ())] == 29
    stub.Release(pb.ReleaseRequest(all=True))
    m = scrape(port)
    assert m[("metrale_live_sequences", ())] == 0 and m[("metrale_kv_blocks_free", ())] == 32


def test_run_ahead_counts(tiny_model_dir):
    port = free_port()
    worker = start_worker(tiny_model_dir, kv_blocks=32, metrics_port=port, run_ahead="on")
    try:
        stub = worker.stub
        r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[3, 4, 5], is_last_chunk=True)]))
        for _ in range(3):      # the first answer is a prefill's: no guess; then two guesses taken
            r = stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[r.tokens[0]]))
        stub.Decode(pb.DecodeRequest(seq_ids=[1], tokens=[(r.tokens[0] + 1) % 256]))    # undone
        stub.Release(pb.ReleaseRequest(all=True))                                        # undone
        m = scrape(port)
        assert m[("metrale_run_ahead_steps_total", (("outcome", "taken"),))] == 2
        assert m[("metrale_run_ahead_steps_total", (("outcome", "undone"),))] == 2
        assert m[("metrale_kv_blocks_free", ())] == 32
    finally:
        worker.stop()


def test_the_readme_lists_every_metric_with_its_help_text(metered):
    """README's metrics table and the registry: the same names (counters with _total), types and help texts."""
    import re
    from pathlib import Path

    worker, _ = metered
    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    section = readme[readme.index("## Metrics"):readme.index("## Layout")]
    rows = {}
    for name, kind, help_text in re.findall(r"^\| `([a-z_]+)(?:\{[a-z,]*\})?` \| (\w+) \| (.+?) \|$", section, re.M):
        rows[name] = (kind, help_text)
    registry = {}
    for family in worker.server.metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        registry[name] = (family.type, family.documentation)
    assert rows == registry
