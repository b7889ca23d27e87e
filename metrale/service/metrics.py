"""Prometheus metrics, on their own HTTP port (--metrics-port). One registry per server."""

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, engine):
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.rpc_seconds = prom.Histogram("metrale_rpc_seconds", "Time to answer an RPC, by RPC.", ["rpc"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.rpc_errors = prom.Counter("metrale_rpc_errors", "RPCs answered with an error, by RPC and status code.",
                                       ["rpc", "code"], registry=r)
        self.tokens = prom.Counter("metrale_tokens", "Tokens run through the model, by kind (prefill or decode).",
                                   ["kind"], registry=r)
        self.expired = prom.Counter("metrale_sequences_expired", "Sequences released for going --sequence-ttl "
                                    "seconds without a step or Fork.", registry=r)
        self.step_sequences = prom.Histogram("metrale_step_sequences", "Sequences in one step.",
                                             buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        live = prom.Gauge("metrale_live_sequences", "Sequences the worker holds.", registry=r)
        live.set_function(lambda: engine.stats().live_sequences)
        free = prom.Gauge("metrale_kv_blocks_free", "KV blocks free in the pool.", registry=r)
        free.set_function(lambda: engine.stats().free_kv_blocks)
        used = prom.Gauge("metrale_kv_blocks_used", "KV blocks held by sequences.", registry=r)
        used.set_function(lambda: _blocks_used(engine.stats()))
        r.register(RunAheadCollector(engine))
        r.register(PrefixCacheCollector(engine))
        r.register(BackendCollector(engine))
        # The labelled series every step touches, looked up once (a lookup takes the metric's lock).
        self._decode_tokens, self._prefill_tokens = self.tokens.labels("decode"), self.tokens.labels("prefill")
        self._rpc_seconds: dict[str, prom.Histogram] = {}

    def count_step(self, step) -> None:
        self._decode_tokens.inc(len(step.decode))
        if step.prefill:
            self._prefill_tokens.inc(sum(len(s.tokens) for s in step.prefill))
        self.step_sequences.observe(len(step.decode) + len(step.prefill))

    def seconds_of(self, rpc: str):
        """The rpc's series of metrale_rpc_seconds."""
        series = self._rpc_seconds.get(rpc)
        if series is None:
            series = self._rpc_seconds[rpc] = self.rpc_seconds.labels(rpc)
        return series

    def count_unauthenticated(self, method: str) -> None:
        """A call the token check refused: its body is never read and it never reaches the RPC's handler."""
        self.rpc_errors.labels(method.rsplit("/", 1)[-1], "UNAUTHENTICATED").inc()

    def serve(self, host: str, port: int) -> None:
        prom.start_http_server(port, addr=host, registry=self.registry)


class RunAheadCollector:
    """The engine's run-ahead counts: guessed decode steps the next request took, and those undone."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily("metrale_run_ahead_steps", "Guessed next decode steps, by outcome "
                                     "(taken by the next request, or undone).", labels=["outcome"])
        counts = self.engine.ahead_counts
        family.add_metric(["taken"], counts.taken)
        family.add_metric(["undone"], counts.undone)
        yield family


class PrefixCacheCollector:
    """The prefix cache: blocks only it holds, prompt blocks looked up (found or not), blocks evicted."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        counts = self.engine.prefix_counts
        hits, misses, evictions = (counts.hits, counts.misses, counts.evictions) if counts else (0, 0, 0)
        yield GaugeMetricFamily("metrale_prefix_cache_blocks", "KV blocks only the prefix cache holds (counted as "
                                "free).", value=self.engine.stats().cached_kv_blocks)
        lookups = CounterMetricFamily("metrale_prefix_cache_lookups", "Full prompt blocks looked up in the prefix "
                                      "cache, by result (hit: reused, or miss: computed).", labels=["result"])
        lookups.add_metric(["hit"], hits)
        lookups.add_metric(["miss"], misses)
        yield lookups
        yield GaugeMetricFamily("metrale_prefix_cache_hit_ratio", "Hits over lookups of prompt blocks so far (0 "
                                "before any).", value=hits / (hits + misses) if hits + misses else 0.0)
        yield CounterMetricFamily("metrale_prefix_cache_evictions", "Cached KV blocks evicted for new ones.",
                                  value=evictions)


class BackendCollector:
    """The backend's own counts: the compiled-kernel cache's lookups at start, and decode graph replays."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        counts = self.engine.backend_counters()
        lookups = CounterMetricFamily("metrale_kernel_cache_lookups", "Compiled kernels looked up in the kernel "
                                      "cache at start, by result (hit, or miss: compiled and added).",
                                      labels=["result"])
        lookups.add_metric(["hit"], counts["kernel_cache_hits"])
        lookups.add_metric(["miss"], counts["kernel_cache_misses"])
        yield lookups
        yield CounterMetricFamily("metrale_graph_replays",
                                  "Forwards run as a CUDA graph replay: decode steps, encoder passes, decoder prompts.",
                                  value=counts["graph_replays"])


def _blocks_used(stats) -> int:
    return stats.num_kv_blocks - stats.free_kv_blocks
