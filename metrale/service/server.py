"""Builds and runs the gRPC server: Worker, health and reflection; drains on SIGTERM."""

import asyncio
import errno
import gc
import signal
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from metrale.runtime.backend import runs_on_cuda
from metrale.runtime.build import ModelInfo, build_engine
from metrale.runtime.own_thread import run_on_own_thread
from metrale.runtime.parallel.group import GlooGroup, Shard
from metrale.runtime.parallel.launch import RankWatch, free_address, start_followers
from metrale.runtime.streams import StreamThreads
from metrale.runtime.loading import Checkpoint
from metrale.service.config import WorkerConfig
from metrale.service.metrics import WorkerMetrics
from metrale.service.preflight import PortUnavailable
from metrale.service.security import TokenAuthInterceptor, read_tokens, server_credentials
from metrale.service.admission import ServingState
from metrale.service.servicer import WorkerServicer
from metrale.service.status import StatusInterceptor
from metrale.v1 import worker_pb2, worker_pb2_grpc

log = structlog.get_logger()
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServer:
    """The running worker: the server, its servicer and health state. start(), then wait() or drain().
    Built on the event loop that will serve it."""

    def __init__(self, engine, info: ModelInfo, tokenizer, config: WorkerConfig, ranks: list | None = None,
                 watch: RankWatch | None = None):
        self.config = config
        # A tensor-parallel worker's other ranks (processes), stopped after the last step, and the watch over them
        # (one is made at start() where none is given).
        self.ranks, self._watch = ranks or [], watch
        self.threads = StreamThreads(config.engine.num_streams, on_thread_start=engine.bind_stream)
        self.state = ServingState(config.max_concurrent_rpcs)
        self.health = health.aio.HealthServicer()
        self.metrics = WorkerMetrics(engine)
        self.servicer = WorkerServicer(engine, self.threads, info, tokenizer, self.state, self.metrics, config,
                                       self._on_device_fault)
        self.options = server_options(config)
        interceptors = [StatusInterceptor(self._on_device_fault, self.metrics)]
        if config.auth_tokens_file:
            interceptors.insert(0, TokenAuthInterceptor(read_tokens(config.auth_tokens_file),
                                                        self.metrics.count_unauthenticated))
        # No maximum_concurrent_rpcs here: grpc's would refuse health checks and Release too (admission.py).
        self.server = grpc.aio.server(interceptors=interceptors, options=self.options)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if config.reflection:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        address = f"{config.host}:{config.port}"
        self.port = bind(lambda: (self.server.add_secure_port(address, credentials) if credentials
                                  else self.server.add_insecure_port(address)), address, "--port")
        self.health_server, self.health_port = None, None
        if config.health_port is not None:      # plaintext, health only: for probes that cannot speak TLS
            self.health_server = grpc.aio.server(options=[EXCLUSIVE_PORT])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            health_address = f"{config.host}:{config.health_port}"
            self.health_port = bind(lambda: self.health_server.add_insecure_port(health_address), health_address,
                                    "--health-port")
        self._stopped = asyncio.Event()
        self._fault_task = None
        self._expiry_task = None

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, config: WorkerConfig) -> "WorkerServer":
        """The engine built on this thread for the CUDA backend (the thread keeps the device's context current), on
        a thread of its own for the CPU backend (own_thread.py: its OpenMP team ends with the build)."""
        group, ranks, watch = None, [], None
        if config.tensor_parallel > 1:
            address = free_address()
            ranks = start_followers(checkpoint.source, config.engine, config.tensor_parallel, address,
                                    config.cache_dir)
            group = GlooGroup(Shard(0, config.tensor_parallel), address)
            watch = RankWatch(ranks, group.lose)        # a rank lost while loading: the build's waits end

        def build():
            return build_engine(checkpoint, config.engine, Path(config.cache_dir) if config.cache_dir else None, group)
        try:
            engine, info = build() if runs_on_cuda(config.engine.device) else run_on_own_thread(build)
            if group is not None:
                group.check()
        except BaseException:
            if watch is not None:
                watch.stop()
            for rank in ranks:
                rank.terminate()
            if group is not None:
                group.close()
            raise
        return cls(engine, info, checkpoint.tokenizer, config, ranks, watch)

    async def start(self) -> None:
        if self.config.metrics_port:
            host, port = self.config.host, self.config.metrics_port
            bind(lambda: self.metrics.serve(host, port), f"{host}:{port}", "--metrics-port")
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.ranks:
            on_lost = self._rank_lost_on(asyncio.get_running_loop())
            if self._watch is None:
                self._watch = RankWatch(self.ranks, on_lost)
            else:                       # the build's, which only ended the build's waits
                self._watch.on_lost = on_lost
            self.servicer.engine.runner.when_lost(on_lost)      # and at once, where lost since the build
        if self.config.sequence_ttl:
            self._expiry_task = asyncio.get_running_loop().create_task(self._expire_idle_sequences())
        log.info("serving", port=self.port, model=self.servicer.info.model_id, device=self.servicer.info.device,
                 kv_blocks=self.servicer.engine.stats().num_kv_blocks)

    async def drain(self) -> None:
        """Health goes NOT_SERVING, new forward RPCs get UNAVAILABLE, in-flight ones finish, then the server stops.
        A second call (a second signal) stops at once."""
        if self.state.draining:
            await self.server.stop(grace=0)
            return
        self.state.draining = True
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining", in_flight=self.state.in_flight)
        try:
            await asyncio.wait_for(self.state.idle.wait(), self.config.drain_timeout)
        except asyncio.TimeoutError:
            log.warning("drain_timeout", in_flight=self.state.in_flight)
        await self.server.stop(grace=1.0)
        if self.health_server is not None:
            await self.health_server.stop(grace=0)
        await asyncio.to_thread(self.threads.close)
        self.servicer.close()
        if self._watch is not None:
            await asyncio.to_thread(self._watch.stop)
        if self.ranks:
            await asyncio.to_thread(self._stop_ranks)
        self._stopped.set()
        log.info("stopped")

    def _stop_ranks(self) -> None:
        """Ends the other ranks' loops (where rank 0 can still reach them) and waits for their processes."""
        try:
            self.servicer.engine.runner.stop()
        except Exception:
            log.warning("tensor_parallel_stop_failed", exc_info=True)
        for rank in self.ranks:
            rank.join(timeout=10)
            if rank.is_alive():
                rank.terminate()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def _expire_idle_sequences(self) -> None:
        """Every quarter of --sequence-ttl (at most 10 s): releases the sequences idle past it. A failed round is
        logged and the next one runs."""
        period = min(self.config.sequence_ttl / 4, 10.0)
        while True:
            await asyncio.sleep(period)
            try:
                await self.servicer.expire_idle()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sequence_expiry_failed")

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _rank_lost_on(self, loop):
        """RankWatch's and DeviceWatch's on_lost: _on_rank_lost on the server's loop (unless the loop is gone, and the
        worker with it)."""
        def on_lost(why: str) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._on_rank_lost, why)
        return on_lost

    def _on_rank_lost(self, why: str) -> None:
        """Another rank's process ended, or a wait on the device for its part outlasted the collectives' timeout,
        while serving: its collectives are left (a step waiting on the device for its part ends, RankLost), every
        later call is RankLost, and health goes NOT_SERVING."""
        log.error("tensor_parallel_rank_lost", why=why)
        self.servicer.engine.runner.lose(why)
        self._on_device_fault()

    def _on_device_fault(self) -> None:
        log.error("device_fault: reporting NOT_SERVING")
        self._fault_task = asyncio.get_running_loop().create_task(
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))


def freeze_heap() -> None:
    """For a process that is the worker (serve, and benches that time it as one): moves every object alive once the
    worker is loaded (the model, torch's and grpc's modules, the engine) out of the collector's reach. A step
    allocates thousands of objects, and each collection of the oldest generation would otherwise walk all of these
    again: a pause of milliseconds in some steps."""
    gc.collect()
    gc.freeze()


# grpc sets SO_REUSEPORT by default: a second worker on the same port would also start, and the kernel would
# split new connections between the two at random. Without it, the second one's bind fails.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def bind(listen, address: str, flag: str):
    """listen(), a port's bind; its failure as PortUnavailable naming the flag. The ports were free before the load
    (preflight.py): another process took this one since."""
    try:
        return listen()
    except RuntimeError as error:         # grpc's add_*_port: "Failed to bind to address ..."
        raise PortUnavailable(address, flag, "address in use, or not an address of this host") from error
    except OSError as error:              # prometheus_client's HTTP server
        problem = "address in use" if error.errno == errno.EADDRINUSE else error.strerror or str(error)
        raise PortUnavailable(address, flag, problem) from error


def server_options(config: WorkerConfig) -> list[tuple[str, int]]:
    """The gRPC core options of the worker's port: an exclusive bind, message sizes and HTTP/2 keepalive."""
    ms = lambda seconds: int(seconds * 1000)
    return [EXCLUSIVE_PORT,
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.keepalive_time_ms", ms(config.keepalive_time)),
            ("grpc.keepalive_timeout_ms", ms(config.keepalive_timeout)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(config.keepalive_min_client_ping)),
            ("grpc.http2.max_pings_without_data", 0)]


async def serve(checkpoint: Checkpoint, config: WorkerConfig) -> None:
    worker = WorkerServer.from_checkpoint(checkpoint, config)
    await worker.start()
    freeze_heap()       # the process is the worker's: what is alive now lives as long as it does
    loop = asyncio.get_running_loop()
    drains = set()

    def on_signal():
        task = loop.create_task(worker.drain())
        drains.add(task)
        task.add_done_callback(drains.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await worker.wait()
