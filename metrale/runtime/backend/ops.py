"""The ops interface every model family is written against; each backend implements it."""

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from metrale.runtime.batch import ForwardBatch
from metrale.runtime.beam.candidates import Candidates
from metrale.runtime.beam.on_device import DeviceSearch, OnDeviceSearch
from metrale.runtime.sampling import SampleResult

# Rows upload_lm_head may add to the LM head (the weight budget counts them).
LM_HEAD_PADDING_ROWS = 64

# A backend's tensor type: torch.Tensor on the CPU backend, a device buffer view on CUDA.
Tensor = Any


@dataclass(frozen=True)
class RopeTable:
    """cos/sin of position * inv_freq for every position: [max_positions, head_dim // 2] float32 each. identity:
    cos 1 and sin 0 everywhere (a model without rotary embeddings), which a backend may skip."""
    cos: Tensor
    sin: Tensor
    identity: bool = False


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
    # Stream lanes: a backend that runs forwards at once gives each its own workspaces.
    lanes: int = 1


class PreparedBatch(Protocol):
    """A ForwardBatch as the backend holds it for one forward; models read these two fields."""
    token_ids: Tensor      # [T]
    sample_rows: Tensor    # [N]


class Ops(Protocol):
    device: str
    dtype: torch.dtype
    # False: one forward at a time (from prepare to sample), whatever the number of lanes.
    concurrent_forwards: bool
    # Exceptions that mean the device itself failed (a driver or library status, a kernel's fault flag): the worker
    # then stops serving. Any other exception in a step is a bug that fails its call alone.
    device_errors: tuple[type[BaseException], ...]
    # The share of available_kv_bytes the KV pool takes where --kv-memory-fraction is not given.
    default_kv_memory_fraction: float
    # Whether --run-ahead auto runs each lane's guessed next decode step: where the device works while the host
    # answers (run_ahead.py).
    runs_ahead_by_default: bool

    def plan(self, weight_bytes: int, shapes: MemoryShapes) -> None:
        """Places weights and workspaces before any upload; the KV pool comes after."""

    def bind_lane(self, lane: int) -> None:
        """Runs the calling thread's forwards on stream lane `lane` (< shapes.lanes) from now on: each device lane's
        thread calls it once, at its start; a thread that never does runs on lane 0. A backend that keeps state per
        lane raises InvalidArgument for a lane out of range."""

    # Whether beam search runs here (BeamGenerate): it needs beam_candidates and copy_kv_prefixes.
    supports_beam: bool
    # The most rows a decode forward replays a CUDA graph for (the largest decode bucket: such a step costs the host
    # one launch, not one per kernel); 0: none.
    decode_graph_rows: int
    # Whether run_prefill replays graphs (an encoder-decoder's short decoder prompts then cost one launch a forward).
    prefill_graphs: bool

    def beam_candidates(self, logits: Tensor, banned: list[list[int]], count: int) -> Candidates:
        """Beam search's candidates: for each logits row, log_softmax in float32, its banned ids (transformers'
        processors) at -inf, then the `count` best, best first; .host() gives them as values [N, count] float32
        and ids [N, count] int64 (beam/candidates.py). Queued, not waited for: a device search seeds from the
        prompt pass's where they are. The logits may be overwritten."""

    def copy_kv_prefixes(self, kv_cache: list, copies: list[tuple[int, int, int]]) -> None:
        """For each (src block, dst block, n): the first n slots of src's K and V, in every layer, into dst."""

    def device_beam_search(self, search: "DeviceSearch", forward: Callable[[ForwardBatch], Tensor], kv_cache: list
                           ) -> "OnDeviceSearch | None":
        """A beam search whose steps run on the device from where the prompt pass left it (runtime/beam/
        on_device.py), on the calling thread's lane; None where the backend has no such step or the search does
        not fit its state region: the host steps it."""

    def counters(self) -> dict[str, int]:
        """Cumulative counts for the metrics: kernel_cache_hits and kernel_cache_misses (compiled kernels found in,
        or added to, the cache at start) and graph_replays (decode steps and encoder passes replayed as CUDA
        graphs); 0 where the backend has none."""

    def synchronize(self) -> None:
        """Waits for the work the calling thread's lane has queued: before a failed or cancelled step gives back
        blocks its queued forward may still be writing, which another lane could take at once."""

    def upload(self, tensor: torch.Tensor) -> Tensor:
        """A weight in the backend's dtype and memory."""

    def upload_lm_head(self, tensor: torch.Tensor) -> Tensor:
        """upload() for the LM head [vocab, hidden] (logits() multiplies by it): a backend may pad its rows (at most
        LM_HEAD_PADDING_ROWS more, zeros) for its GEMM; logits() still returns [N, vocab]."""

    def upload_float32(self, tensor: torch.Tensor) -> Tensor:
        """A float32 table (rope cos/sin) in the backend's memory."""

    def available_kv_bytes(self, fraction: float) -> int:
        """Bytes the KV pool may take: a fraction of the memory left now."""

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, kv_block_size: int, num_kv_heads: int,
                          head_dim: int) -> list[Tensor]:
        """One KV tensor per layer, [2, num_blocks, kv_block_size, num_kv_heads, head_dim]."""

    def prepare(self, batch: ForwardBatch, cross: bool = False) -> PreparedBatch:
        """Moves a batch's metadata to the device once per forward; cross=True: a forward's second batch (its
        ForwardBatch.cross), kept beside the first."""

    def embedding(self, table: Tensor, token_ids: Tensor) -> Tensor:
        """[T] -> [T, hidden]."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """residual = x + residual (or x); returns (rms_norm(residual) * weight, residual)."""

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
                   ) -> tuple[Tensor, Tensor]:
        """As rms_norm, with LayerNorm (mean and variance, weight and bias): (norm(x + residual), x + residual)."""

    def embedding_layer_norm(self, table: Tensor, token_ids: Tensor, positions_table: Tensor, positions: Tensor,
                             weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """layer_norm(embedding(table, token_ids), weight, bias, eps, embedding(positions_table, positions)): an
        embedding layer's two lookups and its first norm (the backend may gather the rows in the norm)."""

    def linear_layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor,
                          norm_bias: Tensor, eps: float, residual: Tensor) -> tuple[Tensor, Tensor]:
        """layer_norm(linear(x, weight, bias), norm_weight, norm_bias, eps, residual): a linear whose output only
        the norm reads (the backend may hand it over in pieces: split-K partials the norm sums)."""

    def write_kv(self, k: Tensor, v: Tensor, batch: PreparedBatch, kv: Tensor) -> None:
        """K and V rows [T, kv_heads * head_dim] into the paged cache at the batch's slots (no rotation): an
        encoder-decoder's cross-attention K/V."""

    def device_ids(self, ids: torch.Tensor) -> Tensor:
        """Host int64 ids [T] as an index tensor of this forward for embedding() (a model's own position ids)."""

    def fairseq_position_ids(self, batch: PreparedBatch, padding_idx: int) -> Tensor:
        """M2M100's position ids as transformers counts them, for a batch of one-token segments (decode steps) or
        of segments holding no padding id (an encoder's sources): padding_idx where the token is padding_idx, else
        position + 1 + padding_idx. From the batch's own metadata, so a graph can capture it."""

    def relu(self, x: Tensor) -> Tensor:
        """max(x, 0), elementwise."""

    def head_rms_norm(self, x: Tensor, weight: Tensor, eps: float, head_dim: int) -> Tensor:
        """RMSNorm over each head_dim slice of x [T, heads * head_dim] (Qwen3 q/k norm)."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [T, in] @ weight[out, in].T (+ bias) -> [T, out]."""

    def linear_relu(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """relu(linear(x, weight, bias)): one GEMM with the activation in its epilogue where the backend can (the
        same values: rounding to bf16 commutes with max(., 0))."""

    def rope_and_write_kv(self, q: Tensor, k: Tensor, v: Tensor, rope: RopeTable, batch: PreparedBatch, kv: Tensor,
                          head_dim: int) -> Tensor:
        """Rotates q and k (rotate-half layout) at the batch positions, writes k and v into kv at the batch
        slots; returns rotated q [T, heads * head_dim]."""

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor, rope: RopeTable, batch: PreparedBatch, kv: Tensor,
                       num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None) -> Tensor:
        """rope_and_write_kv, then causal paged_attention of the rotated q: the batch's new tokens attending
        their sequences' keys and their own -> [T, heads * head_dim]. A backend may do both in one pass."""

    def paged_attention(self, q: Tensor, kv: Tensor, batch: PreparedBatch, num_kv_heads: int, head_dim: int, scale: float,
                        sliding_window: int | None, causal: bool = True) -> Tensor:
        """Attention of each segment's queries over its paged KV -> [T, heads * head_dim]: causal, or (causal=False:
        an encoder's self-attention, a decoder's cross-attention) over all of each segment's context."""

    def cross_attention(self, x: Tensor, weight: Tensor, bias: Tensor | None, kv: Tensor, batch: PreparedBatch,
                        num_kv_heads: int, head_dim: int, scale: float) -> Tensor:
        """paged_attention(linear(x, weight, bias), kv, batch, ..., causal=False): a decoder's cross-attention from
        its query projection (the backend may hand the query over in pieces: split-K partials the attention sums)."""

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """[T, 2 * I] -> silu(gate) * up, [T, I]."""

    def gather_rows(self, x: Tensor, rows: Tensor) -> Tensor:
        """x[rows]."""

    def logits(self, x: Tensor, lm_head: Tensor) -> Tensor:
        """x [N, hidden] @ lm_head[vocab, hidden].T -> [N, vocab] float32."""

    def warm_up(self, forward: Callable[[ForwardBatch], Tensor], graph_batch_sizes: tuple[int, ...],
                max_context: int, max_source_len: int = 0) -> None:
        """Done once the KV pool exists: capture what will be replayed (decode graphs), compile what is lazy.
        max_source_len > 0: an encoder-decoder, whose every decode step has a cross-attention batch over sources
        of up to that many tokens."""

    def run_forward(self, forward: Callable[[ForwardBatch], Tensor], batch: ForwardBatch) -> Tensor:
        """forward(batch): logits [N, vocab] float32 in the backend's memory; a backend may replay a graph."""

    def run_encoder(self, encode: Callable[[ForwardBatch], None], batch: ForwardBatch) -> None:
        """encode(batch): an encoder-decoder's encoder pass, whose launches read the batch only through prepare()
        (so a backend may replay a graph captured for the batch's padded shape)."""

    def run_prefill(self, forward: Callable[[ForwardBatch], Tensor], batch: ForwardBatch) -> Tensor:
        """forward(batch): an encoder-decoder's decoder over segments of several tokens, whose launches read the
        batch (and its cross batch) only through prepare(), so a backend may replay a graph captured for the
        batch's padded shape (prefill_graphs); logits of batch.sample_rows, as run_forward's."""

    def sample(self, logits: Tensor, rows: list, on_queued: Callable[[], None] | None = None) -> "SampleResult":
        """The next token of each row (runtime/sampling's rule), its logprob, top-n and, where asked, the raw
        logits row on the host. on_queued() runs once the device work is queued, before the wait for it (a lane
        hands over its last answer there, so the event loop's work overlaps the device's, not the host's)."""


def rope_then_attention(ops: Ops, q: Tensor, k: Tensor, v: Tensor, rope: RopeTable, batch: PreparedBatch, kv: Tensor,
                        num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None) -> Tensor:
    """Ops.self_attention as its two ops, rope_and_write_kv then causal paged_attention: a backend's self_attention
    where it has nothing fused for the batch."""
    q = ops.rope_and_write_kv(q, k, v, rope, batch, kv, head_dim)
    return ops.paged_attention(q, kv, batch, num_kv_heads, head_dim, scale, sliding_window)
