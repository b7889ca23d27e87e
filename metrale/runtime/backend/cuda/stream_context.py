"""A stream's context: its CUDA stream and every buffer a forward and its sampling write, so forwards on different streams
run at once on the device. The weights and the KV pool are shared: streams never share a sequence, so the KV
blocks they write are disjoint."""

import contextlib
import math
import threading
import time

import numpy as np
import torch
from cuda.core import EventOptions, StreamOptions

from metrale.runtime.backend.cuda import kernels, latent_prefill
from metrale.runtime.backend.cuda.batch import CudaBatch, PrefillPadding, metadata_elements, pack_batch, set_tokens
from metrale.runtime.backend.cuda.device import ALIGNMENT, Arena, CudaDevice, RingArena
from metrale.runtime.backend.cuda.fp8_matrix import BLOCK
from metrale.runtime.backend.cuda.graphs import DecodeGraphs, PrefillGraphs
from metrale.runtime.backend.cuda.sampler import OUT_WORDS, DeviceSampler
from metrale.runtime.backend.cuda.tensor import DTYPES, DeviceTensor
from metrale.runtime.backend.layer_math import LM_HEAD_PADDING_ROWS
from metrale.runtime.backend.runner import MemoryShapes
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.errors import CollectiveFailed, InvalidArgument, ListsTooLarge

GEMM_WORKSPACE_BYTES = 32 << 20
# A step's small per-row lists (the sampler's penalty entries and biases, a beam step's banned ids).
LISTS_BYTES = 64 << 20
# A BeamGenerate call's search state on the device (beam_search.py); a call that needs more steps on the host.
BEAM_STATE_BYTES = 32 << 20
# The activation workspace holds this many layers' tensors at max_batch_tokens (see RingArena).
WORKSPACE_LAYERS = 3
TIMED = EventOptions(timing_enabled=True)
MAX_TIMED_ROUNDS = 1 << 16
# Host arrays a stream's copies read, kept until it is waited for: a stream that is never waited for (a
# tensor-parallel follower's, which samples nothing) waits for its device before a forward once it holds more.
MAX_PENDING = 64
# How often a bounded wait for the stream (StreamContext.wait_limit_s) looks whether it is done, and whether it is
# over anyway (StreamContext.wait_over: rank 0 renews the collectives).
WAIT_POLL_S = 50e-6
WAIT_ASK_S = 0.01

Buffers = dict[str, tuple[tuple[int, ...], str]]


def stream_buffers(lib, shapes: MemoryShapes, ranks: int | None = None) -> Buffers:
    """name -> (shape, dtype) of every buffer one stream owns, sized by the engine's limits; ranks: a tensor-parallel
    worker's (a group of one included), whose vocabulary parts each stream gathers; None: one device, no group."""
    parts = ranks or 1
    t, seqs = shapes.max_batch_tokens, shapes.max_seqs
    per_layer = 2 * t * (4 * shapes.hidden + 2 * shapes.q_size + 2 * shapes.kv_size + 3 * shapes.intermediate
                         + shapes.ssm_width + shapes.moe_width + shapes.latent_width)
    # Decode attention's per-split partial outputs, for the largest batch and context (not in the ring: their size
    # follows the split count, not max_batch_tokens); none without attention (a pure SSM).
    max_context = shapes.max_blocks_per_seq * shapes.kv_block_size
    if shapes.latent_rank:
        partials = kernels.latent_attention.workspace_bound(lib, min(seqs, t), shapes.latent_heads, shapes.latent_rank,
                                                            shapes.latent_rope, max_context)
    elif shapes.q_size:
        partials = kernels.attention.decode_workspace_bound(
            lib, min(seqs, t), shapes.q_size // shapes.head_dim, shapes.kv_size // shapes.head_dim, shapes.head_dim,
            max_context)
    else:
        partials = 0
    buffers = {
        "workspace": ((WORKSPACE_LAYERS * per_layer + 4 * t * shapes.hidden * 2,), "uint8"),
        # The LM head's output in the model's dtype, as transformers' bf16 run has it; as wide as the LM head's
        # padded rows (padded_vocab; the ranks' parts side by side: vocab_part): the GEMM writes them all.
        "logits": ((seqs, parts * vocab_part(shapes.vocab, parts)), "bfloat16"),
        # The sampler's rows: the logits widened to float32, and a penalised copy.
        "widened": ((seqs, shapes.vocab), "float32"),
        "processed": ((seqs, shapes.vocab), "float32"),
        "metadata": ((metadata_elements(t, seqs, shapes.max_blocks_per_seq),), "int32"),
        # A forward's second batch (an encoder-decoder's cross-attention rows), beside the first.
        "cross_metadata": ((metadata_elements(t, seqs, shapes.max_blocks_per_seq),), "int32"),
        # Beam search's KV prefix copies of one step: (src block, dst block, slots), at most one per beam.
        "kv_copies": ((seqs, 3), "int32"),
        "decode_partials": ((max(1, partials),), "float32"),
        "gemm_workspace": ((GEMM_WORKSPACE_BYTES,), "uint8"),
        "sample_params": ((seqs, kernels.sampling.PARAM_WORDS), "int32"),
        "sample_outputs": ((OUT_WORDS * seqs,), "int32"),
        "lists": ((LISTS_BYTES // 4,), "int32"),
        # Beam search's candidates of one step: ids then values, MAX_COUNT of each per row at most.
        "beam_candidates": ((seqs, 2 * kernels.beam.MAX_COUNT), "int32"),
        "beam_state": ((BEAM_STATE_BYTES,), "uint8"),
        # moe_route's count of its finished blocks: 0 between launches (its last block resets it).
        "moe_done": ((1,), "int32"),
    }
    # Tensor parallel: every rank's part of the logits rows, rank after rank (each [rows, part]), as NCCL gathers them.
    if ranks is not None:
        buffers["logits_parts"] = ((ranks * seqs * vocab_part(shapes.vocab, ranks),), "bfloat16")
    # An FP8 linear's input quantized per token (its rows of e4m3, their scales: one a row, or one a row per 128
    # columns for a weight in blocks), read by the GEMM right after.
    if shapes.fp8_width:
        buffers.update({"fp8_input": ((t, shapes.fp8_width), "float8_e4m3"),
                        "fp8_scales": ((t * max(1, shapes.fp8_width // BLOCK),), "float32")})
    # Multi-head latent attention's up-projected prefill (latent_prefill.py), where its head dims are built.
    if shapes.latent_rank and latent_prefill.supports(shapes.latent_nope, shapes.latent_rope, shapes.latent_v):
        sizes = latent_prefill.buffer_elements(shapes.latent_rank + shapes.latent_rope, shapes.latent_heads,
                                               shapes.latent_nope, shapes.latent_v, t)
        buffers.update({"latent_keys": ((sizes["keys"],), "bfloat16"), "latent_merge": ((sizes["merge"],), "float32"),
                        "latent_plan": ((sizes["plan"],), "int32")})
    # Hyper-connection streams and a block's mix: they live through every layer of a forward (not in the ring).
    if shapes.hc_mult:
        n = shapes.hc_mult
        buffers.update({"hyper_streams": ((t, n * shapes.hidden), "bfloat16"), "hyper_post": ((t, n), "float32"),
                        "hyper_comb": ((t, n * n), "float32")})
        buffers.update({f"hyper_{name}": spec for name, spec in kernels.hyper.SCRATCH_SHAPES.items()})
    # Sparse attention's indexer: its head weights, scores of up to index_score_rows rows at a time over the longest
    # context, and each row's chosen tokens (by row, and gathered by decode entry), kept for the layers after it.
    if shapes.index_topk:
        k = min(shapes.index_topk, max_context)         # no context holds more
        buffers.update({"index_weights": ((t, shapes.index_heads), "float32"),
                        "index_scores": ((index_score_rows(t, max_context), max_context), "float32"),
                        "index_selected": ((t, k), "int32"), "index_counts": ((t,), "int32"),
                        "index_decode_selected": ((seqs, k), "int32"), "index_decode_counts": ((seqs, 1), "int32"),
                        "index_rows": ((t,), "int32")})
    return buffers


# The indexer's float32 scores of one launch at the most: rows at a time over the longest context.
INDEX_SCORE_BYTES = 64 << 20


def index_score_rows(max_batch_tokens: int, max_context: int) -> int:
    """Rows the indexer scores at a time: as many as INDEX_SCORE_BYTES hold over max_context (at least 1)."""
    return max(1, min(max_batch_tokens, INDEX_SCORE_BYTES // (4 * max(max_context, 1))))


def _prefixed(buffers: dict, prefix: str) -> dict:
    """The buffers whose names start with prefix, by the rest of their names."""
    return {name[len(prefix):]: tensor for name, tensor in buffers.items() if name.startswith(prefix)}


def padded_vocab(vocab: int) -> int:
    """The LM head's rows on this backend: a multiple of 64, so cuBLASLt picks its aligned kernels for the logits
    GEMM (NLLB's 256206 rows ran on an unaligned sm80 kernel at half the copy rate)."""
    return -(-vocab // LM_HEAD_PADDING_ROWS) * LM_HEAD_PADDING_ROWS


def vocab_part(vocab: int, ranks: int) -> int:
    """The LM head's rows on each of `ranks` tensor-parallel ranks: an equal share, padded as padded_vocab; the last
    rank's rows past the vocabulary are zeros (their logits columns are dropped)."""
    return padded_vocab(-(-vocab // ranks))


def stream_bytes(buffers: Buffers) -> int:
    """The size of one stream's region: every buffer ALIGNMENT-aligned, as Arena.take places them."""
    return sum(-(-math.prod(shape) * DTYPES[dtype][0] // ALIGNMENT) * ALIGNMENT for shape, dtype in buffers.values())


class StreamContext:
    """One stream's stream, buffers, sampler and decode graphs, and the host state of the forward in flight on it.
    Used by one thread at a time: the thread bound to it (warm-up binds the main thread to each stream in turn)."""

    def __init__(self, cuda: CudaDevice, lib, shapes: MemoryShapes, region: Arena, buffers: Buffers):
        self.cuda, self.lib, self.shapes = cuda, lib, shapes
        # Non-blocking: never implicitly ordered after the legacy default stream, nor after another stream.
        self.stream = cuda.device.create_stream(options=StreamOptions(nonblocking=True))
        taken = {name: region.take(shape, dtype) for name, (shape, dtype) in buffers.items()}
        workspace = taken["workspace"]
        self.ring = RingArena(workspace.ptr, workspace.nbytes, f"{region.name} activation workspace")
        self.logits = taken["logits"]     # [max_seqs, padded_vocab]; logits() hands out the vocab columns
        self.logits_parts = taken.get("logits_parts")
        self.metadata, self.cross_metadata = taken["metadata"], taken["cross_metadata"]
        self.kv_copies = taken["kv_copies"]
        self.decode_partials, self.gemm_workspace = taken["decode_partials"], taken["gemm_workspace"]
        self.sampler = DeviceSampler(self, taken["sample_params"], taken["widened"], taken["processed"],
                                     taken["sample_outputs"])
        self.candidates, self.lists = taken["beam_candidates"], taken["lists"]
        self.latest_candidates: StreamCandidates | None = None      # what the candidates buffer holds
        self.beam_state = taken["beam_state"]
        self.moe_done = taken["moe_done"]
        self.fp8_input, self.fp8_scales = taken.get("fp8_input"), taken.get("fp8_scales")
        self.latent_keys, self.latent_merge = taken.get("latent_keys"), taken.get("latent_merge")
        self.latent_plan = taken.get("latent_plan")
        self.hyper, self.index = _prefixed(taken, "hyper_"), _prefixed(taken, "index_")
        # A beam search step's done flags (and fault flag), written here by its fork kernel while the next step is
        # queued: two steps' worth, in pinned memory the device writes directly (no copy between the kernels).
        self.beam_flags = cuda.pinned((2, shapes.max_seqs + 1), "int32")
        self._beam_flags_device = cuda.device_address(self.beam_flags)
        self.graphs: DecodeGraphs | None = None
        self.encoder_graphs: PrefillGraphs | None = None
        self.prompt_graphs: PrefillGraphs | None = None
        self._pending = []   # host arrays the stream's copies read, kept until the stream is synchronized
        self.wait_limit_s: float | None = None      # synchronize()'s bound, where it has one (CudaRunner.bound_waits)
        self.wait_over = lambda: False
        self._prepared: CudaBatch | None = None
        self._prepared_cross: CudaBatch | None = None
        self._timing, self._round_events = False, (None, None)
        self._timed_rounds: list[tuple[object, object]] = []      # while timing: every sampled round's events
        self.copy_to_device(self.moe_done, np.zeros(1, dtype=np.int32))
        if self.hyper:      # no token's pieces have arrived
            self.copy_to_device(self.hyper["arrivals"], np.zeros(self.hyper["arrivals"].shape, dtype=np.int32))
        if self.index:      # row ids 0 .. T-1: the indexer scores every row as a query of its own
            self.copy_to_device(self.index["rows"], np.arange(self.index["rows"].shape[0], dtype=np.int32))

    def new(self, rows: int, cols: int, dtype: str = "bfloat16") -> DeviceTensor:
        """An activation tensor from the ring."""
        return self.ring.take((rows, cols), dtype)

    def prepare(self, batch: ForwardBatch, pad_to: int = 0, cross: bool = False,
                prefill: PrefillPadding | None = None) -> CudaBatch:
        """The batch's metadata on the device (pad_to: a decode graph's padded rows; prefill: a prefill graph's
        padded shapes; see pack_batch); starts the forward's ring over. cross=True: the forward's second batch, in
        its own region; the ring goes on."""
        if self._prepared is not None:      # capturing: the batch already in place
            return self._prepared_cross if cross else self._prepared
        if len(self._pending) > MAX_PENDING:
            self.synchronize()
        key = (self, pad_to, cross, prefill)
        if batch.staged is not None and batch.staged[0] == key:     # packed ahead: only its tokens set now
            prepared = batch.staged[1]
            set_tokens(prepared, batch.token_ids)
        else:
            prepared = self.pack(batch, pad_to, cross, prefill)
        region = self.cross_metadata if cross else self.metadata
        self.copy_to_device(DeviceTensor(region.ptr, prepared.host.shape, "int32"), prepared.host)
        if cross:
            return prepared
        self.ring.reset()
        if self._timing:
            self._round_events = (self.stream.record(options=TIMED), None)
        return prepared

    def pack(self, batch: ForwardBatch, pad_to: int = 0, cross: bool = False,
             prefill: PrefillPadding | None = None) -> CudaBatch:
        """The batch's metadata image for the stream's region, on the host (prepare() copies it over)."""
        rows = max(pad_to, prefill.tokens if prefill else 0, batch.num_tokens)
        segments = max(pad_to, len(batch.sample_rows), *((prefill.segments, prefill.sampled) if prefill else ()))
        if rows > self.shapes.max_batch_tokens or segments > self.shapes.max_seqs:
            raise InvalidArgument("the forward is larger than the memory plan")
        region = self.cross_metadata if cross else self.metadata
        return pack_batch(batch, region, self.shapes.max_blocks_per_seq, pad_to, prefill, self.shapes.ssm_chunk_size,
                          query_rows=not cross and self.shapes.index_topk > 0)

    def stage(self, batch: ForwardBatch, pad_to: int = 0, cross: bool = False) -> None:
        """Packs the batch's image ahead of its prepare() on this stream (which then sets only its tokens), while
        the device runs the step before it: batch.staged. Prepared on another stream, the batch is packed again."""
        batch.staged = ((self, pad_to, cross, None), self.pack(batch, pad_to, cross))

    def beam_candidates(self, logits: DeviceTensor, banned: list[list[int]], count: int) -> "StreamCandidates":
        """Runner.beam_candidates: the kernel over the stream's logits into its candidates buffer, queued. The buffer
        holds one step's: the candidates before are read back first (a no-op where the host has them)."""
        if self.latest_candidates is not None:
            self.latest_candidates.host()
        n = logits.shape[0]
        offsets, banned_ids = self.upload_lists(kernels.beam.pack_banned(banned), "a beam step's banned ids")
        ids = DeviceTensor(self.candidates.ptr, (n, count), "int32")
        values = DeviceTensor(self.candidates.ptr + 4 * n * count, (n, count), "float32")
        kernels.beam.beam_candidates(self.lib, self.stream, logits, offsets, banned_ids, ids, values)
        self.latest_candidates = StreamCandidates(self, ids, values)
        return self.latest_candidates

    def upload_lists(self, parts: list[np.ndarray], what: str) -> list[DeviceTensor]:
        """int32 or float32 arrays back to back in the stream's lists region, in one copy; their device views."""
        host = np.concatenate([np.ascontiguousarray(p, dtype=p.dtype).reshape(-1).view(np.int32) for p in parts])
        if host.size > self.lists.numel:
            raise ListsTooLarge(what, host.size, self.lists.numel)
        if host.size:
            self.copy_to_device(DeviceTensor(self.lists.ptr, host.shape, "int32"), host)
        tensors, offset = [], 0
        for part in parts:
            dtype = "float32" if part.dtype == np.float32 else "int32"
            tensors.append(DeviceTensor(self.lists.ptr + 4 * offset, part.shape, dtype))
            offset += part.size
        return tensors

    @contextlib.contextmanager
    def reuse_prepared(self, prepared: CudaBatch, cross: CudaBatch | None = None):
        """While capturing, the model's prepare() returns the batch (and its cross batch) already in place instead
        of copying."""
        self._prepared, self._prepared_cross = prepared, cross
        try:
            yield
        finally:
            self._prepared = self._prepared_cross = None

    def copy_to_device(self, dst: DeviceTensor, host: np.ndarray) -> None:
        """Asynchronous on the stream's stream; `host` is kept alive until the stream is synchronized."""
        self.cuda.copy_to_device(dst, host, self.stream)
        self._pending.append(host)

    def beam_flags_half(self, half: int, count: int) -> tuple[np.ndarray, int]:
        """Half `half` (0 or 1) of the beam flags: its first `count` entries as the host reads them, and the device
        address a kernel writes them at."""
        return self.beam_flags[half, :count], self._beam_flags_device + half * self.beam_flags.strides[0]

    def copy_to_host(self, src: DeviceTensor) -> np.ndarray:
        """Synchronous: waits for everything queued on the stream before it."""
        host = self.cuda.copy_to_host(src, self.stream)
        self._pending.clear()
        return host

    def synchronize(self) -> None:
        """Waits for everything queued on the stream: at most wait_limit_s where set (CollectiveFailed past it)."""
        if self.wait_limit_s is None:
            self.stream.sync()
        else:
            self._bounded_wait()
        self._pending.clear()

    def _bounded_wait(self) -> None:
        """A tensor-parallel follower's wait: its stream may hold collectives that rank 0 never queued (rank 0's call
        failed partway), which would hold it without end. Where rank 0 says it renews them (wait_over(), asked every
        WAIT_ASK_S), or past the limit, the call fails here and the rank goes on to the renewal (whose abort ends
        them)."""
        done = self.stream.record()
        started = time.monotonic()
        asked = started
        while not done.is_done:
            now = time.monotonic()
            if now - started > self.wait_limit_s:
                raise CollectiveFailed(f"a tensor-parallel step's collectives did not finish in {self.wait_limit_s:g} s")
            if now - asked > WAIT_ASK_S:
                asked = now
                if self.wait_over():
                    raise CollectiveFailed("rank 0 renews the tensor-parallel collectives this step waits on")
            time.sleep(WAIT_POLL_S)

    def time_steps(self, enabled: bool) -> None:
        self._timing = enabled
        self._round_events = (None, None)
        self._timed_rounds.clear()

    def mark_sampled(self) -> None:
        """Called by the sampler once its last kernel is queued."""
        if self._timing:
            self._round_events = (self._round_events[0], self.stream.record(options=TIMED))
            if len(self._timed_rounds) < MAX_TIMED_ROUNDS:
                self._timed_rounds.append(self._round_events)

    def take_rounds(self) -> list[tuple[float, float]]:
        """The sampled rounds timed since the last call, in order, once the stream is done with them: (device ms,
        ms the device had nothing of the stream's queued since the round before ended) each; the first round's
        idle time is NaN."""
        self.synchronize()
        rounds, self._timed_rounds = self._timed_rounds, []
        return [(end - start, start - rounds[i - 1][1] if i else math.nan)
                for i, (start, end) in enumerate(rounds) if start is not None]

    def last_device_ms(self) -> float | None:
        started, sampled = self._round_events
        return sampled - started if started is not None and sampled is not None else None


class StreamCandidates:
    """One beam step's candidates in the stream's candidates buffer (ids [N, count] int32, then values float32): read
    back once, by the first host() (beam/candidates.py); a device search seeds from them while they are the stream's
    latest (StreamContext.latest_candidates), and then releases them."""

    def __init__(self, ctx: StreamContext, ids: DeviceTensor, values: DeviceTensor):
        self.ctx, self.ids, self.values = ctx, ids, values
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None

    def release(self) -> None:
        """Taken on the device (the copies queued): the buffer is the next candidates', with no read back first."""
        if self.on_device:
            self.ctx.latest_candidates = None

    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is None:
            if not self.on_device:      # the stream reads back the latest before overwriting it: these were released
                raise RuntimeError("beam candidates read on the host after a device search took them")
            (n, count), ctx = self.ids.shape, self.ctx
            out = ctx.copy_to_host(DeviceTensor(self.ids.ptr, (2 * n * count,), "int32"))
            self._host = (torch.from_numpy(out[n * count:].view(np.float32).reshape(n, count).copy()),
                          torch.from_numpy(out[:n * count].reshape(n, count).astype(np.int64)))
        return self._host

    @property
    def on_device(self) -> bool:
        """Still in the stream's buffer: no later candidates overwrote them."""
        return self.ctx.latest_candidates is self


class StreamBinding(threading.local):
    """The calling thread's stream context: stream 0's until the thread binds another (each stream's thread does,
    once)."""

    def __init__(self, context: StreamContext):
        self.context = context
