"""Choosing a linear's cuBLASLt algorithm by timing, as a decode step meets its weights: streamed from HBM.

cuBLASLt's heuristic ranks algorithms without running them, and for some shapes its first choice is well behind
another it lists: NLLB-200's LM head at 64 rows 164 us against 143, its 1024 x 1024 linears at 4 rows 7.6 us
against 3.8 (bench/gpu_gemm_algos.py, H200). A tuner times the heuristic's first few on the call's own operands
and keeps the fastest. The timing must see the weights as the step does: a decode step reads each weight once,
from HBM, while back-to-back launches over one small weight would read it from L2 (and favour algorithms that lose
in the step). So each candidate runs as a CUDA graph of launches cycling through copies of the weight that together
span L2_SPAN times the L2, placed in a scratch region (the KV pool before any sequence holds it); a weight that
spans that alone runs over itself.

The backend tunes during warm-up only: CublasLt.linear and fp8_linear call tune() for a shape met for the first time
while a tuner is set (cuda/runner.py's warm-up runs each decode bucket's forward once, eagerly, before capturing it).
"""

import statistics

from cuda.bindings import driver
from cuda.core import EventOptions

from metrale.runtime.backend.cuda.device import ALIGNMENT, check
from metrale.runtime.backend.cuda.graphs import no_collection
from metrale.runtime.backend.cuda.tensor import DeviceTensor

L2_SPAN = 3            # the weight copies span this many L2 caches
CANDIDATES = 8         # the heuristic's first this many are timed
MIN_LAUNCHES = 24      # launches per timed graph (more where the copies are more)
REPEATS = 3            # timed replays per candidate; the median counts
MARGIN = 0.03          # another algorithm replaces the heuristic's first only when this much faster
MIN_WEIGHT_BYTES = 1 << 20   # smaller weights are launch-bound: every algorithm is about as fast


def time_per_launch(stream, launches: list, repeats: int = REPEATS) -> float:
    """Seconds per launch: launches (zero-argument callables enqueueing on `stream`, a cuda.core Stream) captured
    as one graph, replayed `repeats` times after one untimed replay; the median."""
    builder = stream.create_graph_builder()
    with no_collection():
        builder.begin_building("thread_local")
        try:
            for launch in launches:
                launch()
        finally:
            builder.end_building()
    graph = builder.complete()
    graph.upload(stream)
    graph.launch(stream)
    timing = EventOptions(timing_enabled=True)
    elapsed_ms = []
    for _ in range(repeats):
        start = stream.record(options=timing)
        graph.launch(stream)
        end = stream.record(options=timing)
        end.sync()
        elapsed_ms.append(end - start)
    return statistics.median(elapsed_ms) / 1e3 / len(launches)


class AlgoTuner:
    """Times cuBLASLt's candidates for each new linear shape and keeps the fastest. scratch: device bytes the
    tuner may overwrite (weight copies); l2_bytes: the device's L2."""

    def __init__(self, scratch: DeviceTensor, l2_bytes: int):
        self.scratch, self.l2_bytes = scratch, l2_bytes
        self.chosen: dict = {}      # LinearKey -> (index in the heuristic's list, seconds per launch of each)

    def tune(self, lt, key, stream, weight: DeviceTensor, run) -> None:
        """Times key's candidates, each as run(w) (the call's linear over w, a copy of its weight tensor: its output
        is overwritten) and makes lt use the fastest. Leaves the heuristic's choice where the weight is small, or
        where the scratch cannot hold copies spanning the L2."""
        weights = self._weight_copies(weight, stream)
        if weights is None:
            return
        candidates = lt.candidate_algos(key, CANDIDATES)
        launches = max(MIN_LAUNCHES, len(weights))
        times = []
        with no_collection():
            for candidate in candidates:
                lt.use_algo(key, candidate)
                times.append(time_per_launch(stream, [lambda w=weights[i % len(weights)]: run(w)
                                                      for i in range(launches)]))
        best = min(range(len(times)), key=times.__getitem__)
        if times[0] <= times[best] * (1 + MARGIN):
            best = 0
        lt.use_algo(key, candidates[best])
        self.chosen[key] = (best, times)

    def _weight_copies(self, weight: DeviceTensor, stream) -> list[DeviceTensor] | None:
        nbytes = weight.nbytes
        if nbytes < MIN_WEIGHT_BYTES:
            return None
        count = -(-L2_SPAN * self.l2_bytes // nbytes)
        if count == 1:
            return [weight]
        pitch = -(-nbytes // ALIGNMENT) * ALIGNMENT
        if count * pitch > self.scratch.nbytes:
            return None
        copies = [DeviceTensor(self.scratch.ptr + i * pitch, weight.shape, weight.dtype) for i in range(count)]
        for copy in copies:
            check(driver.cuMemcpyDtoDAsync(copy.ptr, weight.ptr, nbytes, int(stream.handle)))
        return copies
