"""The CUDA backend: the ops of ops.py as NVRTC kernels and cuBLASLt GEMMs, each on the calling thread's stream
lane (lane.py), so forwards on different lanes overlap on the device.

No torch on this path: torch only hands over checkpoint tensors at load time."""

from pathlib import Path

import math
import numpy as np
import torch

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.batch import CudaBatch
from metrale.runtime.backend.cuda.beam_search import DeviceBeamSearch, seed_of, state_arrays, state_bytes
from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
from metrale.runtime.backend.cuda.device import ALIGNMENT, Arena, CudaDevice, CUDAError
from metrale.runtime.backend.cuda.gemm import CublasLt
from metrale.runtime.backend.cuda.gemm_tuning import AlgoTuner
from metrale.runtime.backend.cuda.graphs import DecodeGraphs, PrefillGraphs, no_collection
from metrale.runtime.backend.cuda.lane import (Lane, LaneBinding, LaneCandidates, lane_buffers, lane_bytes,
                                                padded_vocab)
from metrale.runtime.backend.cuda.linears import k_splits, linear_into, partials
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.ops import MemoryShapes, RopeTable, rope_then_attention
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.beam.on_device import DeviceSearch
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.sampling import SampleResult


class CudaBackend:
    device = "cuda"
    dtype = torch.bfloat16
    # Each lane has its own stream and buffers; the weights are only read, and lanes never share a sequence.
    concurrent_forwards = True
    supports_beam = True
    # cuda.core's failed driver calls; the backend's own checks (device.check, cuBLASLt's status, a kernel's fault
    # flag) raise DeviceFault, which is a device fault wherever it comes from.
    device_errors = (CUDAError,)
    # Of the device memory left after the weights and the lanes' workspaces: the GPU is the worker's. The 10% margin
    # is for what comes after the pool (graph capture, cuBLASLt's and the driver's own allocations).
    default_kv_memory_fraction = 0.9
    runs_ahead_by_default = True

    def __init__(self, cache_dir: Path, dtype: str = "auto", programmatic_launch: bool = True):
        if dtype not in ("auto", "bfloat16"):
            raise InvalidArgument(f"the CUDA backend runs bfloat16, not {dtype}")
        self.cuda = CudaDevice()
        self.lib = KernelLibrary(self.cuda.arch, KernelCache(cache_dir), programmatic_launch)
        self._weights: Arena | None = None
        self._kv_pool: DeviceTensor | None = None
        self.lanes: list[Lane] = []

    def plan(self, weight_bytes: int, shapes: MemoryShapes) -> None:
        """Places the weights and shapes.lanes copies of a lane's buffers in one allocation; the KV pool takes what
        is left, later."""
        if shapes.lanes < 1:
            raise InvalidArgument(f"the memory plan needs at least one lane, not {shapes.lanes}")
        self.shapes = shapes
        buffers = lane_buffers(self.lib, shapes)
        weights, per_lane = -(-weight_bytes // ALIGNMENT) * ALIGNMENT, lane_bytes(buffers)
        base = self.cuda.allocate(weights + shapes.lanes * per_lane)
        self._weights = Arena(base, weights, "weights")
        self.lanes = [Lane(self.cuda, self.lib, shapes, Arena(base + weights + i * per_lane, per_lane, f"lane {i}"),
                           buffers) for i in range(shapes.lanes)]
        self.gemm = CublasLt(self.lanes[0].gemm_workspace)
        self._bound = LaneBinding(self.lanes[0])

    def bind_lane(self, lane: int) -> None:
        """Runs the calling thread's ops on that lane from now on, and makes the device current on the thread."""
        if not 0 <= lane < len(self.lanes):
            raise InvalidArgument(f"lane {lane} does not exist; the memory plan has {len(self.lanes)}")
        self.cuda.ensure_current()
        self._bound.lane = self.lanes[lane]

    def synchronize(self) -> None:
        self._bound.lane.synchronize()

    def _tune_linears(self, lane: Lane, forward) -> None:
        """Each decode bucket's forward once, eagerly, with the GEMM tuner on: every linear shape a graph will
        replay gets the algorithm that is fastest on its weights streamed from HBM (gemm_tuning.py). The KV pool,
        which no sequence holds yet, takes the weight copies the timing needs; what they leave there is never read
        (a sequence's keys are written before they are attended)."""
        if self._kv_pool is None:
            return
        self.gemm.tuner = AlgoTuner(self._kv_pool, self.cuda.device.properties.l2_cache_size)
        try:
            with no_collection():
                for size in lane.graphs.batch_sizes:
                    lane.graphs.rehearse(forward, size)
            lane.synchronize()
        finally:
            self.gemm.tuner = None

    @property
    def lane(self) -> Lane:
        """The calling thread's lane."""
        return self._bound.lane

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The calling thread's lane's decode graphs."""
        return self._bound.lane.graphs

    def upload(self, tensor: torch.Tensor) -> DeviceTensor:
        return self._upload(tensor.to(torch.bfloat16), "bfloat16")

    def upload_lm_head(self, tensor: torch.Tensor) -> DeviceTensor:
        rows = padded_vocab(tensor.shape[0])
        return self.upload(torch.nn.functional.pad(tensor, (0, 0, 0, rows - tensor.shape[0])))

    def upload_float32(self, tensor: torch.Tensor) -> DeviceTensor:
        return self._upload(tensor.float(), "float32")

    def _upload(self, tensor: torch.Tensor, dtype: str) -> DeviceTensor:
        host = tensor.contiguous().view(torch.int16 if dtype == "bfloat16" else torch.float32).numpy()
        out = self._weights.take(tuple(tensor.shape), dtype)
        self.cuda.copy_to_device(out, host, self.cuda.stream)
        self.cuda.stream.sync()
        return out

    def available_kv_bytes(self, fraction: float) -> int:
        return int(self.cuda.free_memory() * fraction)

    def allocate_kv_cache(self, num_layers, num_blocks, kv_block_size, num_kv_heads, head_dim):
        shape = (2, num_blocks, kv_block_size, num_kv_heads, head_dim)
        layer_bytes = math.prod(shape) * 2
        pool_bytes = num_layers * -(-layer_bytes // ALIGNMENT) * ALIGNMENT
        pool = Arena(self.cuda.allocate(pool_bytes), pool_bytes, "KV pool")
        self._kv_pool = DeviceTensor(pool.base, (pool_bytes,), "uint8")
        return [pool.take(shape, "bfloat16") for _ in range(num_layers)]

    def time_steps(self, enabled: bool) -> None:
        """Benchmarks: events around each round's device work on every lane, from the end of its inputs' upload
        (the forward's first launch or graph replay comes next) to the end of sampling (the one copy back
        excluded); last_device_ms() reads the calling thread's lane's latest round, None when it did not sample."""
        for lane in self.lanes:
            lane.time_steps(enabled)

    def last_device_ms(self) -> float | None:
        return self._bound.lane.last_device_ms()

    def warm_up(self, forward, batch_sizes: tuple[int, ...], max_context: int, max_source_len: int = 0) -> None:
        """Captures every lane's decode buckets now, each over that lane's buffers and stream, so serving never
        captures; before the first lane's captures, its buckets run once eagerly to tune the linears
        (_tune_linears). The calling thread is bound to each lane in turn: forward's ops run on the caller's lane."""
        usable = tuple(b for b in batch_sizes if b <= min(self.shapes.max_seqs, self.shapes.max_batch_tokens))
        if not usable:
            return
        caller = self._bound.lane
        try:
            for index, lane in enumerate(self.lanes):
                self._bound.lane = lane
                lane.graphs = DecodeGraphs(lane, usable, max_context, max_source_len)
                if index == 0:
                    self._tune_linears(lane, forward)
                lane.graphs.capture_all(forward)
                if max_source_len:      # captured as their shapes come
                    lane.encoder_graphs = PrefillGraphs.encoder(lane)
                    lane.prompt_graphs = PrefillGraphs.prompts(lane)
        finally:
            self._bound.lane = caller

    @property
    def decode_graph_rows(self) -> int:
        graphs = self._bound.lane.graphs
        return graphs.batch_sizes[-1] if graphs is not None else 0

    def run_forward(self, forward, batch: ForwardBatch) -> DeviceTensor:
        """forward(batch) -> logits on the device. Decode steps replay a CUDA graph. A forward that samples
        nothing is waited for here (sample() waits for the others): once its step returns, its sequences' KV
        blocks may be freed and handed to a sequence on another lane's stream."""
        lane = self._bound.lane
        self.cuda.ensure_current()
        size = lane.graphs.bucket(batch) if lane.graphs else None
        logits = lane.graphs.run(forward, batch, size) if size else forward(batch)
        if not len(batch.sample_rows):
            lane.synchronize()
        return logits

    def run_encoder(self, encode, batch: ForwardBatch) -> None:
        lane = self._bound.lane
        self.cuda.ensure_current()
        if lane.encoder_graphs is None:
            encode(batch)
        else:
            lane.encoder_graphs.run(encode, batch)

    @property
    def prefill_graphs(self) -> bool:
        return self._bound.lane.prompt_graphs is not None

    def run_prefill(self, forward, batch: ForwardBatch) -> DeviceTensor:
        lane = self._bound.lane
        self.cuda.ensure_current()
        return forward(batch) if lane.prompt_graphs is None else lane.prompt_graphs.run(forward, batch)

    def sample(self, logits: DeviceTensor, rows, on_queued=None) -> SampleResult:
        return self._bound.lane.sampler.sample(logits, rows, on_queued)

    def prepare(self, batch: ForwardBatch, cross: bool = False) -> CudaBatch:
        return self._bound.lane.prepare(batch, cross=cross)

    def write_kv(self, k, v, batch: CudaBatch, kv):
        kernels.rope_kv.write_kv(self.lib, self._bound.lane.stream, k, v, batch.slot_mapping, kv)

    def beam_candidates(self, logits: DeviceTensor, banned: list[list[int]], count: int) -> LaneCandidates:
        return self._bound.lane.beam_candidates(logits, banned, count)

    def counters(self) -> dict[str, int]:
        return {"kernel_cache_hits": self.lib.cache.hits, "kernel_cache_misses": self.lib.cache.misses,
                "graph_replays": sum(graphs.replays for lane in self.lanes
                                     for graphs in (lane.graphs, lane.encoder_graphs, lane.prompt_graphs)
                                     if graphs is not None)}

    def device_beam_search(self, search: DeviceSearch, forward, kv_cache: list) -> DeviceBeamSearch | None:
        lane = self._bound.lane
        seed = seed_of(search, lane)
        arrays = state_arrays(search, self.shapes.max_blocks_per_seq, seeded=seed is not None)
        if state_bytes(arrays, len(search.tables)) > lane.beam_state.nbytes:
            return None
        return DeviceBeamSearch(lane, search, arrays, forward, kv_cache, lane.beam_state, seed)

    def fairseq_position_ids(self, batch: CudaBatch, padding_idx: int) -> DeviceTensor:
        lane = self._bound.lane
        out = lane.ring.take((batch.num_tokens,), "int32")
        kernels.embedding.fairseq_position_ids(self.lib, lane.stream, out, batch.token_ids, batch.positions,
                                               padding_idx)
        return out

    def device_ids(self, ids: torch.Tensor) -> DeviceTensor:
        lane = self._bound.lane
        out = lane.ring.take((ids.shape[0],), "int32")
        lane.copy_to_device(out, ids.numpy().astype(np.int32))
        return out

    def copy_kv_prefixes(self, kv_cache: list, copies: list[tuple[int, int, int]]) -> None:
        lane = self._bound.lane
        host = np.asarray(copies, dtype=np.int32).reshape(-1, 3)
        if len(host) > lane.kv_copies.shape[0]:
            raise InvalidArgument(f"{len(host)} KV copies in one step, over the lane's {lane.kv_copies.shape[0]}")
        rows = DeviceTensor(lane.kv_copies.ptr, host.shape, "int32")
        lane.copy_to_device(rows, host)
        kernels.rope_kv.copy_kv_prefixes(self.lib, lane.stream, kv_cache, rows, len(host))

    def embedding(self, table, token_ids):
        lane = self._bound.lane
        out = lane.new(token_ids.shape[0], table.shape[1])
        kernels.embedding.embedding(self.lib, lane.stream, out, table, token_ids)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        lane = self._bound.lane
        out = lane.new(*x.shape)
        residual_out = lane.new(*x.shape)
        kernels.norm.rms_norm(self.lib, lane.stream, out, x, weight, eps, residual=residual, residual_out=residual_out)
        return out, residual_out

    def layer_norm(self, x, weight, bias, eps, residual=None):
        lane = self._bound.lane
        out, residual_out = lane.new(*x.shape), lane.new(*x.shape)
        kernels.norm.layer_norm(self.lib, lane.stream, out, x, weight, bias, eps, residual=residual,
                                residual_out=residual_out)
        return out, residual_out

    def embedding_layer_norm(self, table, token_ids, positions_table, positions, weight, bias, eps):
        lane, shape = self._bound.lane, (token_ids.shape[0], table.shape[1])
        out, residual_out = lane.new(*shape), lane.new(*shape)
        kernels.norm.layer_norm_gathered(self.lib, lane.stream, out, residual_out, table, token_ids, positions_table,
                                         positions, weight, bias, eps)
        return out, residual_out

    def linear_layer_norm(self, x, weight, bias, norm_weight, norm_bias, eps, residual):
        """Decode-sized linears (linears.SPLITS_BY_ROWS; none for the skinny GEMM) as split-K partials that the norm
        sums: a strided batched GEMM of short K slices fills the GPU at few rows where one GEMM's K loop is long (1024
        x 1024 at 64 rows: 3.9 -> 3.0 us), and cuBLASLt's own split-K reduce kernel goes."""
        m, n = x.shape[0], weight.shape[0]
        splits = k_splits(m, weight.shape[1])
        if splits == 1:
            return self.layer_norm(self.linear(x, weight, bias), norm_weight, norm_bias, eps, residual)
        lane = self._bound.lane
        summed = partials(self.gemm, lane, x, weight, splits)
        out, residual_out = lane.new(m, n), lane.new(m, n)
        kernels.norm.layer_norm_partials(self.lib, lane.stream, out, summed, splits, bias, norm_weight, norm_bias,
                                         eps, residual, residual_out)
        return out, residual_out

    def cross_attention(self, x, weight, bias, kv, batch: CudaBatch, num_kv_heads, head_dim, scale):
        """Decode rows of a multi-head model at the row counts linear_layer_norm splits at: the query's linear as
        split-K partials that the attention kernel sums with the bias, as linear_layer_norm hands its norm (for
        1024 x 1024 at 64 rows, as the out projections went: ~4.9 -> ~3.6 us, not yet timed alone); otherwise the
        linear, then paged_attention."""
        m, n = x.shape[0], weight.shape[0]
        splits = k_splits(m, weight.shape[1])
        if splits == 1 or batch.num_prefill or not batch.num_decode or n != num_kv_heads * head_dim:
            return self.paged_attention(self.linear(x, weight, bias), kv, batch, num_kv_heads, head_dim, scale, None,
                                        causal=False)
        lane = self._bound.lane
        query = partials(self.gemm, lane, x, weight, splits)
        out = lane.new(m, n)
        kernels.attention.paged_decode_attention(
            self.lib, lane.stream, out, query, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
            lane.decode_partials, num_kv_heads, num_kv_heads, head_dim, scale, -1, batch.max_decode_context,
            q_partials=kernels.attention.QueryPartials(splits, bias))
        return out

    def relu(self, x):
        lane = self._bound.lane
        out = lane.new(*x.shape)
        kernels.activation.relu(self.lib, lane.stream, out, x)
        return out

    def head_rms_norm(self, x, weight, eps, head_dim):
        kernels.norm.head_rms_norm(self.lib, self._bound.lane.stream, x, weight, eps, head_dim)
        return x

    def linear(self, x, weight, bias=None):
        lane = self._bound.lane
        out = lane.new(x.shape[0], weight.shape[0])
        linear_into(self.lib, self.gemm, lane, out, x, weight, bias)
        return out

    def linear_relu(self, x, weight, bias=None):
        lane = self._bound.lane
        out = lane.new(x.shape[0], weight.shape[0])
        linear_into(self.lib, self.gemm, lane, out, x, weight, bias, relu=True)
        return out

    def rope_and_write_kv(self, q, k, v, rope: RopeTable, batch: CudaBatch, kv, head_dim):
        # q, k and v are column slices of one qkv buffer, which the kernel takes whole.
        qkv = DeviceTensor(q.ptr, (q.shape[0], q.stride), q.dtype)
        num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
        kernels.rope_kv.rope_and_write_kv(self.lib, self._bound.lane.stream, qkv, rope.cos, rope.sin, batch.positions,
                                          batch.slot_mapping, kv, num_heads, num_kv_heads, head_dim)
        return q

    def self_attention(self, q, k, v, rope: RopeTable, batch: CudaBatch, kv, num_kv_heads, head_dim, scale,
                       sliding_window):
        num_heads = q.shape[1] // head_dim
        if batch.num_prefill or num_heads != num_kv_heads:
            return rope_then_attention(self, q, k, v, rope, batch, kv, num_kv_heads, head_dim, scale, sliding_window)
        # Decode rows of a multi-head model: one kernel rotates and writes each new token and attends it.
        lane = self._bound.lane
        out = lane.new(q.shape[0], q.shape[1])
        cos, sin = (None, None) if rope.identity else (rope.cos, rope.sin)
        new_tokens = kernels.attention.NewTokens(k, v, cos, sin, batch.positions, batch.slot_mapping)
        kernels.attention.paged_decode_attention(
            self.lib, lane.stream, out, q, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
            lane.decode_partials, num_heads, num_kv_heads, head_dim, scale,
            -1 if sliding_window is None else sliding_window, batch.max_decode_context, new_tokens=new_tokens)
        return out

    def paged_attention(self, q, kv, batch: CudaBatch, num_kv_heads, head_dim, scale, sliding_window, causal=True):
        lane = self._bound.lane
        out = lane.new(q.shape[0], q.shape[1])
        num_heads = q.shape[1] // head_dim
        window = -1 if sliding_window is None else sliding_window
        if batch.num_decode:
            kernels.attention.paged_decode_attention(
                self.lib, lane.stream, out, q, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
                lane.decode_partials, num_heads, num_kv_heads, head_dim, scale, window, batch.max_decode_context)
        if batch.num_prefill:
            kernels.attention.paged_prefill_attention(
                self.lib, lane.stream, out, q, kv, batch.prefill_starts, batch.prefill_lens, batch.prefill_contexts,
                batch.prefill_tables, num_heads, num_kv_heads, head_dim, scale, window, batch.num_prefill,
                batch.max_prefill_query, causal)
        return out

    def silu_mul(self, gate_up):
        lane = self._bound.lane
        out = lane.new(gate_up.shape[0], gate_up.shape[1] // 2)
        kernels.activation.silu_mul(self.lib, lane.stream, out, gate_up)
        return out

    def gather_rows(self, x, rows):
        lane = self._bound.lane
        out = lane.new(rows.shape[0], x.shape[1], x.dtype)
        kernels.embedding.gather_rows(self.lib, lane.stream, out, x, rows)
        return out

    def logits(self, x, lm_head):
        lane = self._bound.lane
        out = lane.logits.rows(0, x.shape[0]).columns(0, lm_head.shape[0])
        linear_into(self.lib, self.gemm, lane, out, x, lm_head)
        return out.columns(0, self.shapes.vocab)
