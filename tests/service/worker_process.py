"""A real `python -m metrale.service.cli serve` subprocess on a loopback port, for tests that need a process:
grpcurl, signals, exit codes, environment variables.

The worker binds port 0 (the kernel picks a free port, so parallel test runs cannot collide); the port is read
from its JSON "serving" log line, and the worker counts as started once grpc.health.v1 answers SERVING.
Its stdout and stderr go to log_path, whose tail is put into every start-up error.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.v1 import worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_SERVICE = "metrale.v1.Worker"


def log_events(log_path: Path) -> list[dict]:
    """The JSON log lines the worker wrote so far; other lines (warnings, tracebacks) are skipped."""
    events = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def start_on_free_port(make_worker, free_port, timeout: float, attempts: int = 3) -> tuple["WorkerProcess", int]:
    """(worker, port): make_worker(port) started with a port that was free when asked (its metrics port, say). Asked
    again where the port was taken before the worker bound it: the worker's own port 0 may be handed the very port
    free_port just let go."""
    for attempt in range(attempts):
        port = free_port()
        worker = make_worker(port)
        try:
            worker.start(timeout=timeout)
            return worker, port
        except RuntimeError as error:
            if "address in use" not in str(error) or attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


class WorkerProcess:
    """start() launches the worker and waits for SERVING; stop() sends SIGTERM and returns the exit code."""

    def __init__(self, model: Path, log_path: Path, args: tuple[str, ...] = (), env: dict | None = None,
                 device: str = "cpu"):
        # --log-format json: the port comes from the log; a flag wins over a METRALE_LOG_FORMAT in env.
        self.command = [sys.executable, "-m", "metrale.service.cli", "serve", "--model", str(model),
                        "--device", device, "--host", "127.0.0.1", "--port", "0", "--log-format", "json", *args]
        # The test's own METRALE_* variables must not leak in: only env's reach the worker.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        self.env.update(env or {})
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel)

    @property
    def health(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel)

    def start(self, timeout: float = 60.0) -> "WorkerProcess":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        self.port = self._wait_for_port(deadline)
        self.channel = grpc.insecure_channel(self.address)
        self._wait_for_serving(deadline)
        return self

    def health_status(self, service: str = WORKER_SERVICE, timeout: float = 5.0) -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return self.health.Check(request, timeout=timeout).status

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code; SIGKILL (and a negative code) if it does not exit within timeout."""
        if self.channel is not None:
            self.channel.close()
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def _fail(self, reason: str):
        self.stop(timeout=5.0)
        raise RuntimeError(f"worker did not start: {reason}\ncommand: {' '.join(self.command)}\n"
                           f"log ({self.log_path}):\n{self.log_tail()}")

    def _wait_for_port(self, deadline: float) -> int:
        while time.monotonic() < deadline:
            for event in log_events(self.log_path):
                if event.get("event") == "serving" and "port" in event:
                    return int(event["port"])
            if self.process.poll() is not None:
                self._fail(f"exited with code {self.process.returncode}")
            time.sleep(0.05)
        self._fail("no 'serving' log line with its port before the timeout")

    def _wait_for_serving(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"exited with code {self.process.returncode}")
            try:
                if self.health_status(timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        self._fail(f"health of {WORKER_SERVICE} at {self.address} was not SERVING before the timeout")
