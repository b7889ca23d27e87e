"""Bench-only: an engine that does no work, inside a real WorkerServer, so a round trip measures the API alone."""

from metrale.runtime.build import ModelInfo
from metrale.runtime.config import EngineConfig
from metrale.runtime.engine import EngineStats
from metrale.runtime.reservation import ReleaseResult
from metrale.runtime.run_ahead import RunAheadCounts
from metrale.runtime.step import SequenceOutput, Step, StepOutput
from metrale.service.config import WorkerConfig
from metrale.service.server import WorkerServer

STUB_VOCAB_SIZE = 32000
STUB_INFO = ModelInfo(model_id="stub", architecture="StubForBench", dtype="float32", device="cpu",
                      vocab_size=STUB_VOCAB_SIZE, max_model_len=4096, eos_token_ids=(), bos_token_id=None,
                      pad_token_id=None)


class StubEngine:
    """Engine's interface, instantly: every decode token and last prefill chunk gets token 0, logprob 0.0."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.ahead_counts = RunAheadCounts()
        self.supports_beam = self.is_encoder_decoder = False

    def bind_stream(self, stream: int) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(num_kv_blocks=1, free_kv_blocks=1, live_sequences=0)

    def backend_counters(self) -> dict[str, int]:
        return {"kernel_cache_hits": 0, "kernel_cache_misses": 0, "graph_replays": 0}

    def step(self, step: Step, cancelled=None, run_ahead: bool = False, reply=None) -> StepOutput:
        seq_ids = [ctx.seq_id for ctx in step.decode] + [s.seq_id for s in step.prefill if s.is_last_chunk]
        output = StepOutput([SequenceOutput(seq_id, 0, 0.0) for seq_id in seq_ids], forward_us=0)
        if reply is not None:
            output.reply = reply(output)
        return output

    def rows_returning_logits(self, step: Step) -> int:
        return 0

    def release(self, seq_ids: list[int] | None) -> ReleaseResult:
        return ReleaseResult(released=[], unknown=list(seq_ids or ()), blocks_freed=0)

    def live_seq_ids(self) -> list[int]:
        return []

    def idle_seq_ids(self, seconds: float) -> list[int]:
        return []


def stub_worker_server(config: WorkerConfig) -> WorkerServer:
    """The real WorkerServer (servicer, interceptor, stream threads, options) around StubEngine; call it on the event loop
    that will serve it."""
    return WorkerServer(StubEngine(config.engine), STUB_INFO, None, config)
