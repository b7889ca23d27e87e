"""Rows and tables of bench/gpu_decode.py: one row per (batch or prompt shape, implementation)."""

import dataclasses
import statistics
from dataclasses import dataclass, field

class TimedRow:
    """What a row with step_ms (and a note where there are none) says of its times."""

    @property
    def ok(self) -> bool:
        return bool(self.step_ms)

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.step_ms)


@dataclass
class DecodeRow(TimedRow):
    batch: int
    # "metrale", "grpc" (metrale through gRPC, running ahead), "steps" (the same over one Steps stream),
    # "grpc-sync" (unary, no run-ahead) or "peer"
    impl: str
    floor_ms: float
    # metrale: device time per step (CUDA events from the forward's launch to the end of sampling; on the CPU,
    # the engine's forward_us); grpc: the client's round trip; peer: CUDA events around each graph replay.
    step_ms: list[float] = field(default_factory=list)
    # metrale: host clock around Engine.step; grpc: the round trip less the worker's forward_us (its forward rounds,
    # planning excluded) and queue_us;
    # peer: host wall clock per step over the timed loop.
    other_ms: list[float] = field(default_factory=list)
    note: str = ""
    # Rows through gRPC, where the backend times its rounds: the device's idle time before each step's forward,
    # since the step before it ended sampling.
    idle_ms: list[float] = field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.step_ms)

    @property
    def other_p50_ms(self) -> float | None:
        return statistics.median(self.other_ms) if self.other_ms else None

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.mean_ms * 1e3

    @property
    def times_floor(self) -> float:
        return self.p50_ms / self.floor_ms


@dataclass
class PrefillRow(TimedRow):
    num_seqs: int
    seq_len: int
    impl: str
    flops: float
    gemm_flops_per_s: float
    step_ms: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.num_seqs}x{self.seq_len}"

    @property
    def tflops(self) -> float:
        return self.flops / (self.p50_ms / 1e3) / 1e12

    @property
    def fraction_of_gemm(self) -> float:
        return self.flops / (self.p50_ms / 1e3) / self.gemm_flops_per_s


def format_decode_table(rows: list[DecodeRow]) -> str:
    """One line per row; `x peer` = p50 / the peer's p50 at the batch; `host %` (rows through gRPC) = the share of
    the round trip's p50 over the engine's device step p50 at the batch: what the host adds to the GPU's step."""
    peer = {r.batch: r for r in rows if r.impl == "peer" and r.ok}
    device = {r.batch: r for r in rows if r.impl == "metrale" and r.ok}
    lines = [f"{'batch':>5}  {'impl':<9}  {'p50 ms':>8}  {'mean ms':>8}  {'other ms':>8}  {'tokens/s':>9}  "
             f"{'floor ms':>8}  {'x floor':>7}  {'x peer':>6}  {'host %':>6}  {'idle ms':>7}"]
    for r in rows:
        if not r.ok:
            lines.append(f"{r.batch:>5}  {r.impl:<9}  {'-':>8}  {'-':>8}  {'-':>8}  {'-':>9}  {r.floor_ms:>8.3f}  "
                         f"{'-':>7}  {'-':>6}  {'-':>6}  {'-':>7}  {r.note}")
            continue
        other = f"{r.other_p50_ms:.3f}" if r.other_p50_ms is not None else "-"
        vs_peer = f"{r.p50_ms / peer[r.batch].p50_ms:.2f}" if r.impl != "peer" and r.batch in peer else "-"
        through_grpc = r.impl not in ("metrale", "peer", "hf-eager", "hf-compile") and r.batch in device
        host = f"{100 * (1 - device[r.batch].p50_ms / r.p50_ms):.1f}" if through_grpc else "-"
        idle = [t for t in r.idle_ms if t == t]     # NaN: a first round, with none before it
        idle = f"{statistics.median(idle):.3f}" if idle else "-"
        lines.append(f"{r.batch:>5}  {r.impl:<9}  {r.p50_ms:>8.3f}  {r.mean_ms:>8.3f}  {other:>8}  "
                     f"{r.tokens_per_s:>9.0f}  {r.floor_ms:>8.3f}  {r.times_floor:>7.2f}  {vs_peer:>6}  {host:>6}  "
                     f"{idle:>7}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def format_prefill_table(rows: list[PrefillRow]) -> str:
    peer = {r.label: r for r in rows if r.impl == "peer" and r.ok}
    lines = [f"{'prompts':>8}  {'impl':<9}  {'p50 ms':>8}  {'tokens/s':>9}  {'TFLOP/s':>7}  {'x GEMM':>6}  "
             f"{'x peer':>6}"]
    for r in rows:
        if not r.ok:
            lines.append(f"{r.label:>8}  {r.impl:<9}  {'-':>8}  {'-':>9}  {'-':>7}  {'-':>6}  {'-':>6}  {r.note}")
            continue
        tokens_per_s = r.num_seqs * r.seq_len / r.p50_ms * 1e3
        vs_peer = f"{r.p50_ms / peer[r.label].p50_ms:.2f}" if r.impl != "peer" and r.label in peer else "-"
        lines.append(f"{r.label:>8}  {r.impl:<9}  {r.p50_ms:>8.2f}  {tokens_per_s:>9.0f}  {r.tflops:>7.1f}  "
                     f"{r.fraction_of_gemm:>6.2f}  {vs_peer:>6}" + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)



def row_record(row, **extra) -> dict:
    """A DecodeRow's or PrefillRow's fields for the JSON, its p50 (None where it has no times) and extra."""
    return dict(dataclasses.asdict(row), p50_ms=row.p50_ms if row.ok else None, **extra)
