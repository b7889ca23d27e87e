"""Start-up failures of a real `metrale-worker serve` process: a broken model file, a bad TLS or tokens file, a
port in use (by another worker too) each end in exit code 2 and one line on stderr that names the file or port
and the problem, with no traceback; every file and port is checked before the model loads."""

import json
import os
import shutil
import socket
import subprocess
from concurrent import futures
from pathlib import Path

import gguf
import grpc
import numpy as np
import prometheus_client
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2

from metrale.runtime.errors import InvalidArgument
from metrale.service.config import WorkerConfig
from metrale.service.server import EXCLUSIVE_PORT, server_options
from metrale.v1 import worker_pb2 as pb
from certificates import make_pki
from worker_process import REPO_ROOT, WorkerProcess

# A small KV pool: the model-file cases load the model, and a large pool takes seconds to allocate.
SERVE_ARGS = ("--kv-blocks", "64")


def start(model, *args: str) -> subprocess.Popen:
    """`serve` on 127.0.0.1; its JSON log lines go to stdout, the failure line to stderr."""
    worker = WorkerProcess(model, Path(os.devnull), args=(*SERVE_ARGS, *args))
    return subprocess.Popen(worker.command, cwd=REPO_ROOT, env=worker.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


def finish(process: subprocess.Popen, timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()                    # only if it is still running: the test failed
        process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def serve(model, *args: str) -> subprocess.CompletedProcess:
    return finish(start(model, *args))


def events(stdout: str) -> list[str]:
    return [json.loads(line)["event"] for line in stdout.splitlines() if line.startswith("{")]


def refused(result, *words: str) -> str:
    """The one stderr line of a process that exited 2 without a traceback; it holds every word."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("metrale-worker: ") and all(word in line for word in words), line
    return line


def refused_before_the_load(result, *words: str) -> str:
    line = refused(result, *words)
    assert events(result.stdout) == [], result.stdout     # not even "loading"
    return line


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def held_port():
    """A port a listening socket holds, as a server would (SO_REUSEADDR)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


# name -> what becomes of the tiny model's model.safetensors
BROKEN_SAFETENSORS = {
    "empty": lambda data: b"",
    "truncated": lambda data: data[:len(data) // 2],
    "random": lambda data: os.urandom(len(data) // 8),
}


def write_truncated_gguf(path: Path) -> Path:
    """A GGUF file cut in half, through its tensor data."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 128), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    return path


@pytest.fixture(scope="module")
def broken_models(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """name -> (model, its serve's result). All are served at once: each takes seconds of imports and load."""
    directory = tmp_path_factory.mktemp("broken_models")
    models = {"truncated gguf": write_truncated_gguf(directory / "truncated.gguf")}
    for name, mutate in BROKEN_SAFETENSORS.items():
        models[name] = shutil.copytree(tiny_model_dir, directory / name)
        weights = models[name] / "model.safetensors"
        weights.write_bytes(mutate(weights.read_bytes()))
    processes = {name: start(model) for name, model in models.items()}
    return {name: (models[name], finish(process)) for name, process in processes.items()}


@pytest.mark.parametrize("name", [*sorted(BROKEN_SAFETENSORS), "truncated gguf"])
def test_a_broken_model_file_is_one_line(broken_models, name):
    model, result = broken_models[name]
    problem = "ValueError" if name.endswith("gguf") else "SafetensorError"
    refused(result, f"cannot load the model {model}: {problem}: ")
    assert events(result.stdout) == ["loading"]


def test_a_missing_model_is_one_line_before_the_load(tmp_path):
    model = tmp_path / "no-such-model"
    refused_before_the_load(serve(model), f"cannot load the model {model}: ", "no such file")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, str]:
    """The test PKI's files, a key that is not the server certificate's, and a file that is not PEM."""
    directory = tmp_path_factory.mktemp("startup_pki")
    files = make_pki(directory).files
    other_key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (directory / "other.key").write_bytes(other_key)
    (directory / "garbage.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n")
    return {**files, "other.key": str(directory / "other.key"), "garbage.pem": str(directory / "garbage.pem")}


# case -> (cert, key, client CA, the file the line names, the problem it states)
TLS_CASES = {
    "key of another certificate": ("server.crt", "other.key", None, "other.key", "is not the key of"),
    "garbage certificate": ("garbage.pem", "server.key", None, "garbage.pem", "holds no PEM certificate"),
    "garbage key": ("server.crt", "garbage.pem", None, "garbage.pem", "is not a PEM private key"),
    "garbage client CA": ("server.crt", "server.key", "garbage.pem", "garbage.pem", "holds no PEM certificate"),
}


@pytest.mark.parametrize("case", sorted(TLS_CASES))
def test_a_bad_tls_file_is_one_line_before_the_load(tiny_model_dir, tls_files, case):
    cert, key, client_ca, named, problem = TLS_CASES[case]
    args = ["--tls-cert", tls_files[cert], "--tls-key", tls_files[key]]
    if client_ca is not None:
        args += ["--tls-client-ca", tls_files[client_ca]]
    refused_before_the_load(serve(tiny_model_dir, *args), tls_files[named], problem)


def test_a_tokens_file_that_is_not_utf8_is_one_line_before_the_load(tiny_model_dir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"# tokens\nalpha-\xff\xfe-token\n")
    result = serve(tiny_model_dir, "--auth-tokens-file", str(tokens))
    refused_before_the_load(result, str(tokens), "not UTF-8", "byte 15")


@pytest.mark.parametrize("flag", ["--port", "--health-port", "--metrics-port"])
def test_a_port_in_use_is_one_line_before_the_load(tiny_model_dir, held_port, flag):
    result = serve(tiny_model_dir, flag, str(held_port))
    refused_before_the_load(result, f"127.0.0.1:{held_port}", flag, "address in use")


def test_the_ports_of_one_worker_must_differ(tiny_model_dir):
    port = free_port()
    result = serve(tiny_model_dir, "--port", str(port), "--health-port", str(port))
    refused_before_the_load(result, "health_port must differ from port", str(port))
    with pytest.raises(InvalidArgument, match="metrics_port must differ from health_port"):
        WorkerConfig(port=0, health_port=9100, metrics_port=9100)
    assert WorkerConfig(port=0, health_port=0).health_port == 0     # 0: two free ports the kernel picks


def test_two_workers_never_share_a_port(tiny_model_dir, tmp_path):
    first = WorkerProcess(tiny_model_dir, tmp_path / "first.log", args=SERVE_ARGS).start()
    try:
        second = serve(tiny_model_dir, "--port", str(first.port))
        refused_before_the_load(second, f"127.0.0.1:{first.port}", "address in use")
        assert first.health_status() == health_pb2.HealthCheckResponse.SERVING
        assert first.stub.Info(pb.InfoRequest(), timeout=10).vocab_size > 0
    finally:
        assert first.stop() == 0, first.log_tail()


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_taken_during_the_load_is_one_line(tiny_model_dir, flag):
    """The port is free at the check and taken while the model loads: the real bind (grpc's, or
    prometheus_client's) fails, and ends in the same line."""
    port = free_port()
    process = start(tiny_model_dir, flag, str(port))
    with socket.socket() as holder:
        try:
            first_line = process.stdout.readline()   # the checks are done once "loading" is logged
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", port))
            holder.listen()
        except BaseException:
            process.kill()
            raise
        result = finish(process, timeout=30)
    assert events(first_line) == ["loading"], first_line
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    # grpc logs its own line about the failed bind first; the worker's is the last.
    line = result.stderr.splitlines()[-1]
    assert line.startswith("metrale-worker: ") and f"127.0.0.1:{port} ({flag})" in line, result.stderr
    assert "address in use" in line and "serving" not in events(result.stdout)


def test_the_grpc_and_metrics_ports_bind_exclusively():
    """grpc's default SO_REUSEPORT would let a second server bind the port and take half of its connections."""
    options = server_options(WorkerConfig())
    assert EXCLUSIVE_PORT in options
    pool = futures.ThreadPoolExecutor(1)
    # Without the option two servers share a port: the failure this guards against.
    shared = [grpc.server(pool) for _ in range(2)]
    port = shared[0].add_insecure_port("127.0.0.1:0")
    assert shared[1].add_insecure_port(f"127.0.0.1:{port}") == port
    # Two workers' servers, as they are built: the second cannot bind.
    first, second = grpc.server(pool, options=options), grpc.server(pool, options=options)
    port = first.add_insecure_port("127.0.0.1:0")
    with pytest.raises(RuntimeError, match="Failed to bind"):
        second.add_insecure_port(f"127.0.0.1:{port}")
    for server in (*shared, first):
        server.stop(None)
    pool.shutdown()
    metrics, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        with pytest.raises(OSError) as in_use:
            prometheus_client.start_http_server(metrics.server_port, addr="127.0.0.1")
        assert "in use" in str(in_use.value)
    finally:
        metrics.shutdown()
        metrics.server_close()
