"""Checks every file and port of the config before the model loads: a bad file or a taken port then costs no load
(seconds to minutes), and ends in one line that names it."""

import errno
import os
import socket
from pathlib import Path

from metrale.runtime.errors import InvalidArgument, ModelLoadError, WorkerError
from metrale.service.config import WorkerConfig
from metrale.service.security import read_tokens, server_credentials


class PortUnavailable(WorkerError):
    """A port the worker must listen on is taken by another process, or cannot be bound at all."""

    def __init__(self, address: str, flag: str, problem: str):
        self.address = address
        super().__init__(f"cannot listen on {address} ({flag}): {problem}")


def check_before_load(config: WorkerConfig) -> None:
    """Raises the first problem found: the model path, the TLS files, the tokens file, then the ports."""
    if config.model is not None:           # None: the embedded default model, which the fetch checks
        check_model_path(Path(config.model))
    server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    if config.auth_tokens_file is not None:
        read_tokens(config.auth_tokens_file)
    for port, flag in ((config.port, "--port"), (config.health_port, "--health-port"),
                       (config.metrics_port, "--metrics-port")):
        if port:                           # None: off; 0: the kernel picks a free port at the bind
            check_port(config.host, port, flag)


def check_model_path(path: Path) -> None:
    """The model is there and readable; whether its contents load is for the load to say."""
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    if not path.is_dir() and path.suffix != ".gguf":
        raise ModelLoadError(path, "neither a Hugging Face model directory nor a .gguf file")
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            path.open("rb").close()
    except OSError as error:
        raise ModelLoadError(path, error.strerror) from None


def check_port(host: str, port: int, flag: str) -> None:
    """Binds host:port as grpc and prometheus_client will (SO_REUSEADDR, no SO_REUSEPORT), then lets it go. The
    port can still be taken during the load; the real bind then fails with the same line."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        resolved = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise InvalidArgument(f"cannot listen on {address} ({flag}): host {host!r} does not resolve "
                              f"({error.strerror})") from None
    failures = [error for error in map(_bind_error, resolved) if error is not None]
    # grpc serves when some of a name's addresses bind ("localhost": 127.0.0.1 and ::1); a taken one is refused
    # all the same, or clients of that address would reach the other process.
    if any(error.errno == errno.EADDRINUSE for error in failures):
        raise PortUnavailable(address, flag, "address in use (another worker or process listens there)")
    if len(failures) == len(resolved):
        raise PortUnavailable(address, flag, failures[0].strerror)


def _bind_error(resolved_address) -> OSError | None:
    family, kind, protocol, _, socket_address = resolved_address
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(socket_address)
        except OSError as error:
            return error
    return None
