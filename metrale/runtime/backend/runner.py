"""The runner interface: what the engine asks of a backend besides the layer math. It holds the memory plan and
the cache's memory, binds host threads to device streams, runs forwards (replaying graphs where it has them),
samples, steps beam searches and copies cache contents. Each backend implements it (cpu/, cuda/)."""

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from metrale.runtime.batch import ForwardBatch
from metrale.runtime.beam.candidates import Candidates
from metrale.runtime.beam.on_device import SearchStart, DeviceSearch
from metrale.runtime.cache.specs import LayerCache
from metrale.runtime.sampling import SampleResult

Tensor = object


class QueuedSample(Protocol):
    def result(self) -> SampleResult:
        """Waits for the queued sampling; its outputs on the host."""


@dataclass(frozen=True)
class MemoryShapes:
    """What a backend's memory plan is sized by: the model's dimensions and the engine's limits."""
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    vocab: int
    max_batch_tokens: int
    max_seqs: int
    max_blocks_per_seq: int
    head_dim: int
    kv_block_size: int
    # Activation elements per token of a layer's state-space mixer (0: none), beside its attention and MLP.
    ssm_width: int = 0
    # The tokens of a state-space mixer's scan chunk (0: none): longer segments are scanned chunk by chunk at once.
    ssm_chunk_size: int = 0
    # Activation elements per token of a layer's mixture of experts (0: none), beside its attention.
    moe_width: int = 0
    # Multi-head latent attention (latent_rank 0: none): its heads, latent and rotary widths, a head's key dims
    # without position and value dims, and the activation elements per token its attention takes beyond q_size and
    # kv_size's (the latent-space query and output).
    latent_heads: int = 0
    latent_rank: int = 0
    latent_rope: int = 0
    latent_nope: int = 0
    latent_v: int = 0
    latent_width: int = 0
    # Hyper-connection streams of the residual (0: none).
    hc_mult: int = 0
    # DeepSeek sparse attention's indexer (index_topk 0: none): its heads, head dims and tokens a query keeps.
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    # The widest input of a linear whose weight is FP8 (0: none): each stream's buffer for that input quantized per
    # token, for the W8A8 GEMM.
    fp8_width: int = 0
    # Device streams: a backend that runs forwards at once gives each its own workspaces.
    streams: int = 1


class Runner(Protocol):
    device: str
    dtype: torch.dtype
    # False: one forward at a time (from prepare to sample), whatever the number of streams.
    concurrent_forwards: bool
    # Exceptions that mean the device itself failed (a driver or library status, a kernel's fault flag): the worker
    # then stops serving. Any other exception in a step is a bug that fails its call alone.
    device_errors: tuple[type[BaseException], ...]
    # The share of available_cache_bytes the cache takes where --kv-memory-fraction is not given.
    default_kv_memory_fraction: float
    # Whether --run-ahead auto runs each stream's guessed next decode step: where the device works while the host
    # answers (run_ahead.py).
    runs_ahead_by_default: bool
    # Whether run_forward and queue_sample return once the work is queued, before it is done (the host may answer
    # meanwhile): a taken guess's successor is then queued before the answer is built, else run after it.
    queues_work: bool
    # Whether beam search runs here (BeamGenerate): it needs beam_candidates and copy_block_prefixes.
    supports_beam: bool
    # The --kv-dtype values its attention reads (cache/specs.py's KV_DTYPES: "fp8" is PagedKvFp8 layers).
    kv_dtypes: tuple[str, ...]
    # The most rows a decode forward replays a CUDA graph for (the largest decode bucket: such a step costs the host
    # one launch, not one per kernel); 0: none.
    decode_graph_rows: int
    # Whether run_forward replays graphs for replayable forwards over segments of several tokens (an
    # encoder-decoder's short decoder prompts then cost one launch a forward).
    prefill_graphs: bool

    def plan(self, weight_bytes: int, shapes: MemoryShapes) -> None:
        """Places weights and workspaces before any upload; the cache comes after."""

    def bind_stream(self, stream: int) -> None:
        """Runs the calling thread's forwards on device stream `stream` (< shapes.streams) from now on: each
        stream's thread calls it once, at its start; a thread that never does runs on stream 0. A backend that
        keeps state per stream raises InvalidArgument for a stream out of range."""

    def synchronize(self) -> None:
        """Waits for the work the calling thread's stream has queued: before a failed or cancelled step gives back
        blocks its queued forward may still be writing, which another stream could take at once."""

    def available_cache_bytes(self, fraction: float) -> int:
        """Bytes the cache may take: a fraction of the memory left now."""

    def allocate_cache(self, specs: tuple[LayerCache, ...], num_blocks: int, block_size: int, num_state_slots: int
                       ) -> list:
        """Each layer's cache as its spec says (cache/specs.py): a paged tensor, a tuple of state tensors, or None.
        InvalidArgument for a kind of layer the backend has no kernels for."""

    def warm_up(self, forward: Callable[[ForwardBatch], Tensor], graph_batch_sizes: tuple[int, ...],
                max_context: int, max_source_len: int = 0) -> None:
        """Done once the cache exists: capture what will be replayed (decode graphs), compile what is lazy.
        max_source_len > 0: an encoder-decoder, whose every decode step has a cross-attention batch over sources
        of up to that many tokens."""

    def run_forward(self, forward: Callable[[ForwardBatch], Tensor], batch: ForwardBatch, replayable: bool) -> Tensor:
        """forward(batch): logits [N, vocab] float32 in the backend's memory. replayable: the forward's launches read
        the batch only through prepare() (the model says, model.replayable), so a graph captured for its padded
        shape may be replayed instead."""

    def stage(self, batch: ForwardBatch) -> None:
        """Builds on the host, ahead of run_forward, what running the batch will need (where the runner has such
        work: a decode graph's metadata image), on the calling thread's stream; run_forward then only sets the
        batch's token ids, which may change meanwhile (in place), and nothing else may."""

    def run_encoder(self, encode: Callable[[ForwardBatch], None], batch: ForwardBatch, replayable: bool) -> None:
        """encode(batch): an encoder-decoder's encoder pass, replayed as run_forward's may be."""

    def queue_sample(self, logits: Tensor, rows: list) -> "QueuedSample":
        """Queues the sampling of each row (runtime/sampling's rule) on the calling thread's stream; the result()
        of what it returns waits for it: each row's next token, its logprob, top-n and, where asked, the raw
        logits row, on the host. Between the two the host may queue more (a stream's guessed next step is
        planned there) or hand an answer over; the stream's next queue_sample comes after this one's result()."""

    def beam_candidates(self, logits: Tensor, banned: list[list[int]], count: int) -> Candidates:
        """Beam search's candidates: for each logits row, log_softmax in float32, its banned ids (transformers'
        processors) at -inf, then the `count` best, best first; .host() gives them as values [N, count] float32
        and ids [N, count] int64 (beam/candidates.py). Queued, not waited for: a device search seeds from the
        prompt pass's where they are. The logits may be overwritten."""

    def device_search(self, search: SearchStart, forward: Callable[[ForwardBatch], Tensor], layers: list
                           ) -> DeviceSearch | None:
        """A beam search whose steps run on the device from where the prompt pass left it (runtime/beam/
        on_device.py), on the calling thread's stream; None where the backend has no such step or the search
        does not fit its limits or its state region: the host steps it."""

    def copy_block_prefixes(self, layers: list, copies: list[tuple[int, int, int]]) -> None:
        """For each (src block, dst block, n): the first n slots of src, in every paged layer, into dst."""

    def copy_state_slots(self, layers: list, copies: list[tuple[int, int]]) -> None:
        """For each (src slot, dst slot): the recurrent state of src, in every recurrent layer, into dst."""

    def counters(self) -> dict[str, int]:
        """Cumulative counts for the metrics: kernel_cache_hits and kernel_cache_misses (compiled kernels found in,
        or added to, the cache at start) and graph_replays (forwards replayed as CUDA graphs: decode steps, encoder
        passes, decoder prompts); 0 where the backend has none."""
