"""The worker's one typed config, parsed once from flags and METRALE_<FLAG> environment variables."""

import argparse
import os
from dataclasses import dataclass, field, fields

from metrale.runtime.cache.specs import KV_DTYPES
from metrale.runtime.config import DEVICES, DTYPES, RUN_AHEAD, EngineConfig
from metrale.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class WorkerConfig:
    # None: the embedded default model (fetched by `metrale-worker fetch-default-model`).
    model: str | None = None
    host: str = "0.0.0.0"
    port: int = 50051
    max_message_mb: int = 64
    # The most UTF-8 bytes of text one Tokenize or Generate prompt takes (tokenizing a megabyte takes seconds).
    max_text_bytes: int = 1 << 20
    # Forward calls (steps, BeamGenerate, Generate) in flight at once; one more gets RESOURCE_EXHAUSTED (None: no
    # limit). Control calls (health, Info, Release, ...) are not counted.
    max_concurrent_rpcs: int | None = None
    # HTTP/2 keepalive: the server pings an idle connection every keepalive_time seconds and drops it if no answer
    # comes within keepalive_timeout; clients may ping no more often than keepalive_min_client_ping seconds.
    keepalive_time: float = 60.0
    keepalive_timeout: float = 20.0
    keepalive_min_client_ping: float = 10.0
    metrics_port: int | None = None
    # A plaintext port serving only grpc.health.v1 (kubelet's gRPC probes speak neither TLS nor tokens).
    health_port: int | None = None
    # Seconds SIGTERM waits for in-flight RPCs before the process exits.
    drain_timeout: float = 30.0
    # Seconds a sequence may go without a step or Fork before the worker releases it (0: never), so that a gateway
    # that crashed cannot hold the pool.
    sequence_ttl: float = 300.0
    reflection: bool = True
    # TLS: PEM files of the server's certificate and key; with a client CA, clients must show a certificate it
    # signed (mutual TLS). auth_tokens_file: bearer tokens, one per line (the health service stays open).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens_file: str | None = None
    log_format: str = "auto"
    cache_dir: str | None = None
    # Ranks the model is split over (runtime/parallel/): this process serves and runs rank 0, the others are
    # processes it starts. 1: one device.
    tensor_parallel: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_mb < 1:
            raise InvalidArgument(f"max_message_mb must be >= 1, got {self.max_message_mb}")
        if self.max_text_bytes < 1:
            raise InvalidArgument(f"max_text_bytes must be >= 1, got {self.max_text_bytes}")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise InvalidArgument(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        for name in ("keepalive_time", "keepalive_timeout", "keepalive_min_client_ping"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise InvalidArgument(f"metrics_port must be in [1, 65535], got {self.metrics_port}")
        if self.health_port is not None and not 0 <= self.health_port < 65536:
            raise InvalidArgument(f"health_port must be in [0, 65535], got {self.health_port}")
        # Two servers on one port would split its clients between them (or the second would not start).
        taken = {}                                  # port -> the field that has it; 0 (any free port) never clashes
        for name in ("port", "health_port", "metrics_port"):
            port = getattr(self, name)
            if port and port in taken:
                raise InvalidArgument(f"{name} must differ from {taken[port]}, both are {port}")
            taken[port] = name
        if not self.drain_timeout >= 0:
            raise InvalidArgument(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if not 1 <= self.tensor_parallel <= 64:
            raise InvalidArgument(f"tensor_parallel must be in [1, 64], got {self.tensor_parallel}")
        if not self.sequence_ttl >= 0:
            raise InvalidArgument(f"sequence_ttl must be >= 0 seconds (0: never), got {self.sequence_ttl}")
        if self.log_format not in ("auto", "json", "console"):
            raise InvalidArgument(f"log_format must be auto, json or console, got {self.log_format!r}")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# (flag, type, help, choices); defaults come from the dataclasses.
SERVE_FLAGS = [
    ("model", str, "Hugging Face model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct", None),
    ("device", str, "where the model runs", DEVICES),
    ("dtype", str, "weights and activations; auto: float32 on cpu, bfloat16 on cuda", DTYPES),
    ("host", str, "address to listen on", None),
    ("port", int, "gRPC port", None),
    ("kv-blocks", int, "KV blocks in the pool (overrides --kv-memory-fraction)", None),
    ("kv-memory-fraction", float, "fraction of the memory left after the weights and workspaces that the KV pool "
     "takes; default 0.9 on cuda, 0.25 of free RAM on cpu", None),
    ("kv-block-size", int, "tokens per KV block (a power of two)", None),
    ("max-batch-tokens", int, "most tokens one forward may run", None),
    ("max-seqs", int, "most sequences one forward samples (decode tokens plus finishing prompts)", None),
    ("max-model-len", int, "longest sequence; default: the model's max_position_embeddings", None),
    ("cuda-graph-batch-sizes", _int_tuple, "decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8 ('' = off)",
     None),
    ("num-streams", int, "device streams that run steps independently", None),
    ("run-ahead", str, "run each stream's likely next decode step while the gateway reads the last one; "
     "auto: on for cuda", RUN_AHEAD),
    ("prefix-cache", _bool, "keep full KV blocks and reuse them for prompts that start with the same tokens "
     "(on|off)", None),
    ("ssm-snapshot-memory", int, "bytes of SSM state snapshots the prefix cache keeps at block boundaries, for "
     "models with Mamba2 layers; default: as many snapshots as --max-seqs", None),
    ("dequantize", _bool, "GGUF's quantized blocks dequantized at load to --dtype instead of multiplied as they are "
     "on the CPU backend (true|false)", None),
    ("quantize", str, "fp8: a checkpoint's linear weights quantized at load to FP8 (e4m3, one scale a row)",
     ("none", "fp8")),
    ("kv-dtype", str, "fp8: attention K and V cached in FP8 (e4m3, a scale per KV head: the checkpoint's k_scale "
     "and v_scale, else 1), half a bf16 cache's bytes; the CPU backend, and CUDA from sm_89. auto: the model's "
     "dtype", KV_DTYPES),
    ("tensor-parallel", int, "ranks the model is split over (heads and MLP columns, Megatron-style), one process "
     "each; the CPU backend and the dense Llama family for now", None),
    ("max-message-mb", int, "largest gRPC message, either way", None),
    ("max-concurrent-rpcs", int, "forward calls (steps, BeamGenerate, Generate) in flight at once; more get "
     "RESOURCE_EXHAUSTED; health, Info and Release are never refused (unset: no limit)", None),
    ("max-text-bytes", int, "most UTF-8 bytes of text one Tokenize or Generate prompt takes", None),
    ("keepalive-time", float, "seconds between the server's keepalive pings on an idle connection", None),
    ("keepalive-timeout", float, "seconds a keepalive ping may go unanswered before the connection is closed",
     None),
    ("keepalive-min-client-ping", float, "least seconds between a client's keepalive pings; faster pingers are "
     "disconnected", None),
    ("metrics-port", int, "Prometheus metrics port (off when unset)", None),
    ("health-port", int, "a plaintext port serving only grpc.health.v1, for probes when the main port has TLS "
     "(off when unset)", None),
    ("drain-timeout", float, "seconds SIGTERM waits for in-flight RPCs", None),
    ("sequence-ttl", float, "seconds a sequence may go without a step or Fork before it is released (0: never)",
     None),
    ("reflection", _bool, "serve gRPC server reflection", None),
    ("tls-cert", str, "PEM certificate (chain) of the server: serve TLS (with --tls-key)", None),
    ("tls-key", str, "PEM private key of --tls-cert", None),
    ("tls-client-ca", str, "PEM CA bundle: clients must present a certificate it signed (mutual TLS)", None),
    ("auth-tokens-file", str, "bearer tokens, one per line: every call but health needs "
     "'authorization: Bearer <token>'", None),
    ("log-format", str, "auto: JSON unless stdout is a terminal", ("auto", "json", "console")),
    ("cache-dir", str, "where the default model and kernel cache live; default ~/.cache/metrale", None),
]


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for flag, kind, help_text, choices in SERVE_FLAGS:
        env = "METRALE_" + flag.upper().replace("-", "_")
        parser.add_argument(f"--{flag}", type=kind, choices=choices, default=None,
                            help=f"{help_text} [env {env}]")


def config_from_args(args: argparse.Namespace, environ: dict | None = None) -> WorkerConfig:
    """Flags win over METRALE_<FLAG> variables, which win over the defaults."""
    environ = os.environ if environ is None else environ
    values = {}
    for flag, kind, _, _ in SERVE_FLAGS:
        name = flag.replace("-", "_")
        value = getattr(args, name, None)
        env = environ.get("METRALE_" + name.upper())
        if value is None and env is not None and (env != "" or kind is _int_tuple):
            try:
                value = kind(env)
            except (ValueError, argparse.ArgumentTypeError) as error:
                raise InvalidArgument(f"METRALE_{name.upper()}={env!r}: {error}") from None
        if value is not None:
            values[name] = value
    engine_names = {f.name for f in fields(EngineConfig)}
    engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
    return WorkerConfig(engine=engine, **{k: v for k, v in values.items() if k not in engine_names})
