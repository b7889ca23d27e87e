"""A real client in another language: Node.js with @grpc/grpc-js and @grpc/proto-loader (tests/node, from npm)
runs Info, Prefill, three Decodes, three more over a Steps channel (and a failed step) and Release against a running
worker and gets the same tokens as the Python client for the same requests."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from google.rpc import status_pb2

from metrale.v1 import worker_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "node"
PROMPT = [5, 17, 99, 3, 42, 200, 7]


def node_client(address: str, seq_id: int, prompt: list[int]) -> dict:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("the Node.js client needs node and its packages: npm ci --prefix tests/node "
                    "(scripts/setup-tests.sh does it)")
    googleapis = Path(status_pb2.__file__).parents[2]       # google/rpc/status.proto, which worker.proto imports
    result = subprocess.run([node, str(NODE_DIR / "client.mjs"), address, str(ROOT / "protos/metrale/v1/worker.proto"),
                             str(googleapis), str(seq_id), ",".join(map(str, prompt))], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def python_client(stub, seq_id: int, prompt: list[int]) -> list[int]:
    reply = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=prompt, is_last_chunk=True)]))
    tokens = [reply.tokens[0]]
    for _ in range(6):
        tokens.append(stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[tokens[-1]])).tokens[0])
    stub.Release(pb.ReleaseRequest(seq_ids=[seq_id]))
    return tokens


def test_node_client_gets_what_the_python_client_gets(worker, stub):
    from_node = node_client(worker.address, 41, PROMPT)
    info = stub.Info(pb.InfoRequest())
    assert from_node["vocab_size"] == info.vocab_size and from_node["architecture"] == info.architecture
    assert from_node["released"] == ["41"]
    assert from_node["step_ids"] == ["100", "101", "102", "200"] and from_node["error_code"] == 5     # NOT_FOUND
    assert from_node["tokens"] == python_client(stub, 42, PROMPT)
    assert worker.engine.stats().live_sequences == 0
