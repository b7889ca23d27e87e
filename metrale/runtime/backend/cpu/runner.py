"""The CPU backend's runner (runner.py's interface): forwards run as they are called, sampling and beam candidates
in torch, the cache in RAM."""

import math
import os

import torch

from metrale.runtime.beam.candidates import HostCandidates, best_first
from metrale.runtime.backend.cpu.fp8_kv import Fp8Kv
from metrale.runtime.cache.specs import NoCache, PagedIndexKeys, PagedKv, PagedKvFp8, PagedLatent, RecurrentState
from metrale.runtime.sampling import SampleResult, sample


class CpuRunner:
    device = "cpu"
    concurrent_forwards = True
    device_errors = ()      # torch's CPU kernels cannot fault a device: an error there is a bug of ours
    # Of the free RAM: the CPU backend shares its machine (development, CI, the default model).
    default_kv_memory_fraction = 0.25
    runs_ahead_by_default = False       # the host computes the step itself: a guess would only compete with it
    queues_work = False
    supports_beam = True
    kv_dtypes = ("auto", "fp8")
    decode_graph_rows = 0
    prefill_graphs = False

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def plan(self, weight_bytes, shapes) -> None:
        """torch allocates as it goes on the CPU."""

    def bind_stream(self, stream: int) -> None:
        """The CPU runner keeps no state per stream: nothing to bind."""

    def synchronize(self) -> None:
        """The CPU ops are done when they return."""

    def available_cache_bytes(self, fraction: float) -> int:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction)

    def allocate_cache(self, specs, num_blocks, block_size, num_state_slots) -> list:
        return [self._layer_cache(spec, num_blocks, block_size, num_state_slots) for spec in specs]

    def _layer_cache(self, spec, num_blocks: int, block_size: int, num_state_slots: int):
        if isinstance(spec, PagedKv):
            return torch.zeros((2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim), dtype=self.dtype)
        if isinstance(spec, PagedKvFp8):
            return Fp8Kv(spec, num_blocks, block_size)
        if isinstance(spec, (PagedLatent, PagedIndexKeys)):
            return torch.zeros((num_blocks, block_size, spec.width), dtype=self.dtype)
        if isinstance(spec, RecurrentState):
            return tuple(torch.zeros((num_state_slots, *shape), dtype=torch.float32) for shape in spec.shapes)
        assert isinstance(spec, NoCache), spec
        return None

    def warm_up(self, forward, graph_batch_sizes, max_context, max_source_len=0) -> None:
        """Nothing to capture on the CPU."""

    def run_forward(self, forward, batch, replayable):
        return forward(batch)

    def stage(self, batch) -> None:
        """Nothing to build ahead on the CPU."""

    def run_encoder(self, encode, batch, replayable):
        encode(batch)

    def queue_sample(self, logits, rows) -> "ReadySample":
        """Sampled at once: the forward ran already, nothing is left to queue."""
        return ReadySample(sample(logits, rows))

    def beam_candidates(self, logits: torch.Tensor, banned: list[list[int]], count: int) -> HostCandidates:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        vocab = log_probs.shape[-1]
        for row, ids in enumerate(banned):
            inside = [i for i in ids if 0 <= i < vocab]
            if inside:
                log_probs[row, inside] = -math.inf
        return HostCandidates(*best_first(log_probs, min(count, vocab)))

    def device_search(self, search, forward, layers) -> None:
        return None      # the host steps the search (BeamGroup)

    def copy_block_prefixes(self, layers: list, copies: list[tuple[int, int, int]]) -> None:
        for layer in layers:
            if isinstance(layer, Fp8Kv):
                layer = layer.values
            if not isinstance(layer, torch.Tensor):      # a recurrent state, or no cache
                continue
            for src, dst, n in copies:
                if layer.dim() == 3:        # latent, index keys: [blocks, block_size, width]
                    layer[dst, :n] = layer[src, :n]
                else:                       # K/V: [2, blocks, block_size, heads, head_dim]
                    layer[:, dst, :n] = layer[:, src, :n]

    def copy_state_slots(self, layers: list, copies: list[tuple[int, int]]) -> None:
        for layer in layers:
            if isinstance(layer, tuple):         # a recurrent layer's state tensors [slots, ...]
                for tensor in layer:
                    for src, dst in copies:
                        tensor[dst] = tensor[src]

    def counters(self) -> dict[str, int]:
        return {"kernel_cache_hits": 0, "kernel_cache_misses": 0, "graph_replays": 0}


class ReadySample:
    """A sampling done when it was queued (Runner.queue_sample's answer on the CPU)."""

    __slots__ = ("_result",)

    def __init__(self, result: SampleResult):
        self._result = result

    def result(self) -> SampleResult:
        return self._result
