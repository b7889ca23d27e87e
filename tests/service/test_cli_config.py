"""The command line: flags and METRALE_<FLAG> variables parse into one WorkerConfig; bad values exit 2."""

import argparse
import os
import subprocess
import sys

import pytest

from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import InvalidArgument
from metrale.service import cli
from metrale.service.config import SERVE_FLAGS, WorkerConfig, add_serve_flags, config_from_args
from metrale.v1 import worker_pb2 as pb
from tiny_models import write_tiny
from worker_process import REPO_ROOT, WorkerProcess

# flag -> (a text value that is not the default, the config attribute it sets, the parsed value)
NON_DEFAULT = {
    "model": ("/models/llama", "model", "/models/llama"),
    "device": ("cpu", "engine.device", "cpu"),
    "dtype": ("bfloat16", "engine.dtype", "bfloat16"),
    "host": ("127.0.0.2", "host", "127.0.0.2"),
    "port": ("6000", "port", 6000),
    "kv-blocks": ("7", "engine.kv_blocks", 7),
    "kv-memory-fraction": ("0.5", "engine.kv_memory_fraction", 0.5),
    "kv-block-size": ("32", "engine.kv_block_size", 32),
    "max-batch-tokens": ("1024", "engine.max_batch_tokens", 1024),
    "max-seqs": ("64", "engine.max_seqs", 64),
    "max-model-len": ("100", "engine.max_model_len", 100),
    "num-streams": ("3", "engine.num_streams", 3),
    "run-ahead": ("off", "engine.run_ahead", "off"),
    "prefix-cache": ("off", "engine.prefix_cache", False),
    "dequantize": ("true", "engine.dequantize", True),
    "quantize": ("fp8", "engine.quantize", "fp8"),
    "kv-dtype": ("fp8", "engine.kv_dtype", "fp8"),
    "tensor-parallel": ("2", "tensor_parallel", 2),
    "ssm-snapshot-memory": ("1048576", "engine.ssm_snapshot_memory", 1048576),
    "cuda-graph-batch-sizes": ("1,4,16", "engine.cuda_graph_batch_sizes", (1, 4, 16)),
    "max-message-mb": ("8", "max_message_mb", 8),
    "max-text-bytes": ("4096", "max_text_bytes", 4096),
    "max-concurrent-rpcs": ("100", "max_concurrent_rpcs", 100),
    "keepalive-time": ("30", "keepalive_time", 30.0),
    "keepalive-timeout": ("5.5", "keepalive_timeout", 5.5),
    "keepalive-min-client-ping": ("2", "keepalive_min_client_ping", 2.0),
    "metrics-port": ("9100", "metrics_port", 9100),
    "health-port": ("9101", "health_port", 9101),
    "drain-timeout": ("2.5", "drain_timeout", 2.5),
    "sequence-ttl": ("90", "sequence_ttl", 90.0),
    "reflection": ("false", "reflection", False),
    "log-format": ("console", "log_format", "console"),
    "cache-dir": ("/var/cache/metrale", "cache_dir", "/var/cache/metrale"),
    "tls-cert": ("/etc/metrale/tls/tls.crt", "tls_cert", "/etc/metrale/tls/tls.crt"),
    "tls-key": ("/etc/metrale/tls/tls.key", "tls_key", "/etc/metrale/tls/tls.key"),
    "tls-client-ca": ("/etc/metrale/tls/ca.crt", "tls_client_ca", "/etc/metrale/tls/ca.crt"),
    "auth-tokens-file": ("/etc/metrale/auth/tokens", "auth_tokens_file", "/etc/metrale/auth/tokens"),
}
# DESIGN.md section 3b: `serve` takes at least these.
DESIGN_FLAGS = {"model", "device", "dtype", "host", "port", "kv-blocks", "kv-memory-fraction", "kv-block-size",
                "max-batch-tokens", "num-streams", "max-message-mb", "metrics-port"}


def parse_namespace(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(argv))


def parse(*argv: str, environ: dict | None = None) -> WorkerConfig:
    return config_from_args(parse_namespace(*argv), {} if environ is None else environ)


def attribute(config: WorkerConfig, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


def env_name(flag: str) -> str:
    return "METRALE_" + flag.upper().replace("-", "_")


@pytest.fixture(autouse=True)
def no_metrale_environment(monkeypatch):
    """main() reads os.environ: the tests' own METRALE_* variables must not change what it parses."""
    for name in [n for n in os.environ if n.startswith("METRALE_")]:
        monkeypatch.delenv(name)


def test_every_flag_is_covered_here_and_design_flags_exist():
    flags = {flag for flag, *_ in SERVE_FLAGS}
    assert flags == set(NON_DEFAULT)
    assert DESIGN_FLAGS <= flags


def test_defaults():
    config = parse()
    assert config == WorkerConfig(engine=EngineConfig())
    assert config.port == 50051 and config.engine.kv_block_size == 16 and config.reflection is True


@pytest.mark.parametrize("flag", sorted(NON_DEFAULT))
def test_flag_sets_its_field(flag):
    text, path, value = NON_DEFAULT[flag]
    assert attribute(parse(f"--{flag}", text), path) == value
    assert attribute(parse(), path) != value


@pytest.mark.parametrize("flag", sorted(NON_DEFAULT))
def test_environment_variable_sets_its_field(flag):
    text, path, value = NON_DEFAULT[flag]
    assert attribute(parse(environ={env_name(flag): text}), path) == value


def test_flags_win_over_environment():
    environ = {"METRALE_KV_BLOCK_SIZE": "32", "METRALE_PORT": "6000", "METRALE_REFLECTION": "off",
               "METRALE_DTYPE": "float16"}
    config = parse("--kv-block-size", "64", "--port", "7000", "--reflection", "true", environ=environ)
    assert config.engine.kv_block_size == 64 and config.port == 7000 and config.reflection is True
    # Variables without a flag on the command line still apply.
    assert config.engine.dtype == "float16"


def test_empty_variable_is_unset_and_explicit_environ_ignores_os_environ(monkeypatch):
    monkeypatch.setenv("METRALE_PORT", "6000")
    assert parse(environ={"METRALE_KV_BLOCK_SIZE": ""}).engine.kv_block_size == 16
    assert parse(environ={}).port == 50051
    assert config_from_args(parse_namespace(), None).port == 6000


@pytest.mark.parametrize("environ, words", [
    ({"METRALE_KV_BLOCK_SIZE": "24"}, ["kv_block_size", "power of two", "24"]),
    ({"METRALE_PORT": "70000"}, ["port", "70000"]),
    ({"METRALE_PORT": "fifty"}, ["METRALE_PORT", "fifty"]),
    ({"METRALE_DTYPE": "fp8"}, ["dtype", "fp8"]),
    ({"METRALE_DEVICE": "tpu"}, ["device", "tpu"]),
    ({"METRALE_REFLECTION": "maybe"}, ["METRALE_REFLECTION", "maybe"]),
    ({"METRALE_LOG_FORMAT": "xml"}, ["log_format", "xml"]),
    ({"METRALE_NUM_STREAMS": "0"}, ["num_streams", "0"]),
    ({"METRALE_RUN_AHEAD": "sometimes"}, ["run_ahead", "sometimes"]),
    ({"METRALE_QUANTIZE": "int4"}, ["quantize", "int4"]),
    ({"METRALE_KV_DTYPE": "int8"}, ["kv_dtype", "int8"]),
    ({"METRALE_KV_MEMORY_FRACTION": "1.5"}, ["kv_memory_fraction", "1.5"]),
    ({"METRALE_SEQUENCE_TTL": "-1"}, ["sequence_ttl", "-1"]),
])
def test_bad_environment_value_is_invalid_argument(environ, words):
    with pytest.raises(InvalidArgument) as error:
        parse(environ=environ)
    assert all(word in str(error.value) for word in words), str(error.value)


@pytest.mark.parametrize("argv, words", [
    (["--kv-block-size", "24"], ["kv_block_size", "24"]),
    (["--port", "70000"], ["port", "70000"]),
    (["--max-message-mb", "0"], ["max_message_mb"]),
])
def test_main_exits_2_with_a_message_for_a_bad_value(capsys, argv, words):
    assert cli.main(["serve", "--model", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("metrale-worker: ") and all(word in err for word in words), err


def test_main_exits_2_for_an_unknown_dtype_flag(capsys):
    # argparse rejects a value outside the flag's choices itself: SystemExit(2), usage on stderr.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", "/nonexistent", "--dtype", "fp8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "fp8" in err


def test_main_exits_2_for_an_unknown_dtype_variable(capsys, monkeypatch):
    monkeypatch.setenv("METRALE_DTYPE", "fp8")
    assert cli.main(["serve", "--model", "/nonexistent"]) == 2
    assert "fp8" in capsys.readouterr().err


def test_process_exit_code_is_2_for_a_bad_variable():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "METRALE_KV_BLOCK_SIZE": "24"}
    result = subprocess.run([sys.executable, "-m", "metrale.service.cli", "serve", "--model", "/nonexistent"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "kv_block_size must be a power of two, got 24" in result.stderr


def test_environment_reaches_a_running_worker(tmp_path):
    model = write_tiny("llama_tied", tmp_path / "llama")
    env = {"METRALE_KV_BLOCK_SIZE": "32", "METRALE_NUM_STREAMS": "2", "METRALE_MAX_MODEL_LEN": "200",
           "METRALE_KV_BLOCKS": "5"}
    # --kv-blocks on the command line wins over METRALE_KV_BLOCKS.
    worker = WorkerProcess(model, tmp_path / "worker.log", args=("--kv-blocks", "9"), env=env).start()
    try:
        info = worker.stub.Info(pb.InfoRequest(), timeout=10)
    finally:
        assert worker.stop() == 0, worker.log_tail()
    assert info.kv_block_size == 32
    assert info.num_streams == 2 and info.max_model_len == 200
    assert info.num_kv_blocks == 9
