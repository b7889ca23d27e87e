"""The CUDA runner (backend/runner.py's interface): the memory plan and the KV pool, each thread's stream,
forwards as CUDA graph replays where a captured shape fits, sampling and beam search on the device."""

import math

import numpy as np
import torch

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.kernels.attention import hopper_prefill_available
from metrale.runtime.backend.cuda.beam_search import CudaDeviceSearch, fits, seed_of, state_arrays, state_bytes
from metrale.runtime.backend.cuda.resources import CudaResources
from metrale.runtime.backend.cuda.sampler import QueuedRows
from metrale.runtime.backend.cuda.device import ALIGNMENT, Arena, CUDAError
from metrale.runtime.backend.cuda.gemm_tuning import AlgoTuner
from metrale.runtime.backend.cuda.graphs import DecodeGraphs, PrefillGraphs, no_collection
from metrale.runtime.backend.cuda.stream_context import StreamContext, StreamCandidates
from metrale.runtime.backend.cuda.compiler import arch_number
from metrale.runtime.backend.cuda.tensor import DTYPES, DeviceTensor, Fp8KvTensor
from metrale.runtime.backend.cuda.tensor_maps import paged_kv_map
from metrale.runtime.backend.runner import MemoryShapes
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.beam.on_device import SearchStart
from metrale.runtime.cache.specs import NoCache, PagedIndexKeys, PagedKv, PagedKvFp8, PagedLatent, RecurrentState
from metrale.runtime.errors import InvalidArgument


class CudaRunner:
    device = "cuda"
    dtype = torch.bfloat16
    # Each stream has its own CUDA stream and buffers; the weights are only read, and streams never share a sequence.
    concurrent_forwards = True
    supports_beam = True
    # cuda.core's failed driver calls; the backend's own checks (device.check, cuBLASLt's status, a kernel's fault
    # flag) raise DeviceFault, which is a device fault wherever it comes from.
    device_errors = (CUDAError,)
    # Of the device memory left after the weights and the streams' buffers: the GPU is the worker's. The 10% margin
    # is for what comes after the pool (graph capture, cuBLASLt's and the driver's own allocations).
    default_kv_memory_fraction = 0.9
    runs_ahead_by_default = True
    queues_work = True

    def __init__(self, resources: CudaResources):
        self.resources, self.cuda, self.lib = resources, resources.cuda, resources.lib
        # The attention kernels read bf16 K/V, and e4m3 K/V from sm_89 on (the conversions are Ada's and later).
        self.kv_dtypes = ("auto", "fp8") if arch_number(self.lib.arch) >= 89 else ("auto",)
        self._states: kernels.ssm.StateTable | None = None     # the recurrent layers' state tensors, where any
        if resources.collectives is not None:
            resources.collectives.before_abort.append(self._close_graphs)

    def plan(self, weight_bytes: int, shapes: MemoryShapes) -> None:
        self.resources.plan(weight_bytes, shapes)

    @property
    def streams(self) -> list[StreamContext]:
        """Every stream's context, in stream order."""
        return self.resources.streams

    @property
    def stream_context(self) -> StreamContext:
        """The calling thread's stream context."""
        return self.resources.bound.context

    def bind_stream(self, stream: int) -> None:
        """Runs the calling thread's forwards on that stream from now on, and makes the device current on the
        thread."""
        contexts = self.resources.streams
        if not 0 <= stream < len(contexts):
            raise InvalidArgument(f"stream {stream} does not exist; the memory plan has {len(contexts)}")
        self.cuda.ensure_current()
        self.resources.bound.context = contexts[stream]

    def synchronize(self) -> None:
        self.resources.bound.context.synchronize()

    def available_cache_bytes(self, fraction: float) -> int:
        return int(self.cuda.free_memory() * fraction)

    def allocate_cache(self, specs: tuple, num_blocks: int, block_size: int, num_state_slots: int) -> list:
        """One pool allocation holding a [2, blocks, block_size, heads, head_dim] bf16 tensor per PagedKv layer (e4m3
        per PagedKvFp8 layer, an Fp8KvTensor; its scales last), a [blocks, block_size, width] one
        per PagedLatent or PagedIndexKeys spec, at equal strides where they are alike (copy_kv_prefixes needs that),
        then a RecurrentState layer's float32 [slots, *shape] tensors (a tuple each) and the table ssm_copy_slots
        reads them by; None for a NoCache layer."""
        paged, dtypes = {}, {}
        for i, spec in enumerate(specs):
            if isinstance(spec, (PagedKv, PagedKvFp8)):
                paged[i] = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
                dtypes[i] = "float8_e4m3" if isinstance(spec, PagedKvFp8) else "bfloat16"
            elif isinstance(spec, (PagedLatent, PagedIndexKeys)):
                paged[i] = (num_blocks, block_size, spec.width)
            elif not isinstance(spec, (RecurrentState, NoCache)):
                raise InvalidArgument(f"the CUDA backend has no kernels for {type(spec).__name__} layers yet")
        states = {i: [(num_state_slots, *shape) for shape in spec.shapes]
                  for i, spec in enumerate(specs) if isinstance(spec, RecurrentState) and num_state_slots}
        scales = {i: (2, spec.num_kv_heads) for i, spec in enumerate(specs) if isinstance(spec, PagedKvFp8)}
        tensors = [(shape, dtypes.get(i, "bfloat16")) for i, shape in paged.items()]
        tensors += [(shape, "float32") for shape in scales.values()]
        tensors += [(shape, "float32") for shapes in states.values() for shape in shapes]
        count = sum(map(len, states.values()))
        if count:
            tensors += [((count,), "int64")] * 2            # the state table's bases and slot_words
        pool_bytes = sum(-(-math.prod(shape) * DTYPES[dtype][0] // ALIGNMENT) * ALIGNMENT for shape, dtype in tensors)
        if not pool_bytes:
            return [None] * len(specs)
        pool = Arena(self.cuda.allocate(pool_bytes), pool_bytes, "cache pool")
        layers: list = [pool.take(paged[i], dtypes.get(i, "bfloat16")) if i in paged else None
                        for i in range(len(specs))]
        for i, spec in enumerate(specs):   # the tensor maps prefill attention loads through, before any capture
            if isinstance(spec, PagedKv) and hopper_prefill_available(self.lib.arch, spec.head_dim):
                paged_kv_map(layers[i])
        for i, shapes in states.items():
            layers[i] = tuple(pool.take(shape, "float32") for shape in shapes)
        # The KV and state tensors, which the GEMM tuner may use as scratch before any sequence holds them (not the
        # FP8 scales and the state table after them).
        self.resources.kv_pool = DeviceTensor(pool.base, (pool.used,), "uint8")
        for i, shape in scales.items():    # past the tuner's scratch, as the state table is
            layers[i] = Fp8KvTensor(layers[i].ptr, layers[i].shape, layers[i].dtype,
                                    scales=self._uploaded(pool.take(shape, "float32"), specs[i].scales))
        if count:
            self._states = self._state_table(pool, [t for i in states for t in layers[i]])
        return layers

    def _uploaded(self, tensor: DeviceTensor, values) -> DeviceTensor:
        """tensor, holding values (host numbers of its shape) once the upload is done."""
        self.cuda.copy_to_device(tensor, np.asarray(values, dtype=DTYPES[tensor.dtype][1]), self.cuda.stream)
        self.cuda.stream.sync()
        return tensor

    def _state_table(self, pool: Arena, tensors: list[DeviceTensor]) -> kernels.ssm.StateTable:
        """The state tensors' addresses and slot sizes, uploaded once."""
        words = [t.nbytes // t.shape[0] // 16 for t in tensors]
        if any(t.nbytes // t.shape[0] % 16 for t in tensors):
            raise InvalidArgument("a recurrent state's slot is not a whole number of 16-byte words")
        bases = self._uploaded(pool.take((len(tensors),), "int64"), [t.ptr for t in tensors])
        slot_words = self._uploaded(pool.take((len(tensors),), "int64"), words)
        return kernels.ssm.StateTable(bases, slot_words, len(tensors), max(words))

    def warm_up(self, forward, graph_batch_sizes: tuple[int, ...], max_context: int, max_source_len: int = 0) -> None:
        """Captures every stream's decode buckets now, each over that stream's buffers and stream, so serving never
        captures; before the first stream's captures, its buckets run once eagerly to tune the linears
        (_tune_linears). The calling thread is bound to each stream in turn: forward's ops run on the caller's stream."""
        shapes, bound = self.resources.shapes, self.resources.bound
        usable = tuple(b for b in graph_batch_sizes if b <= min(shapes.max_seqs, shapes.max_batch_tokens))
        if not usable:
            return
        caller = bound.context
        try:
            for index, ctx in enumerate(self.resources.streams):
                bound.context = ctx
                ctx.graphs = DecodeGraphs(ctx, usable, max_context, max_source_len, recurrent=self._states is not None)
                if index == 0:
                    self._tune_linears(ctx, forward)
                ctx.graphs.capture_all(forward)
                if max_source_len:      # captured as their shapes come
                    ctx.encoder_graphs = PrefillGraphs.encoder(ctx)
                    ctx.prompt_graphs = PrefillGraphs.prompts(ctx)
        finally:
            bound.context = caller

    def _tune_linears(self, ctx: StreamContext, forward) -> None:
        """Each decode bucket's forward once, eagerly, with the GEMM tuner on: every linear shape a graph will
        replay gets the algorithm that is fastest on its weights streamed from HBM (gemm_tuning.py). The KV pool,
        which no sequence holds yet, takes the weight copies the timing needs; what they leave there is never read
        (a sequence's keys are written before they are attended)."""
        gemm, kv_pool = self.resources.gemm, self.resources.kv_pool
        if kv_pool is None:
            return
        gemm.tuner = AlgoTuner(kv_pool, self.cuda.device.properties.l2_cache_size)
        try:
            with no_collection():
                for size in ctx.graphs.batch_sizes:
                    ctx.graphs.rehearse(forward, size)
            ctx.synchronize()
        finally:
            gemm.tuner = None

    def _close_graphs(self) -> None:
        """Every stream's graphs closed, captured again as they are next used: they captured the collectives of a
        communicator about to be aborted (collectives.py), whose abort waits for them to be gone. Every rank closes
        them at the same call (RENEW), so the ranks capture again at the same forward."""
        for ctx in self.resources.streams:
            for graphs in (ctx.graphs, ctx.encoder_graphs, ctx.prompt_graphs):
                if graphs is not None:
                    graphs.forget()

    def bound_waits(self, seconds: float, renewing) -> None:
        """A tensor-parallel follower: every wait for a stream at most `seconds`, and over once renewing() (rank 0
        renews the collectives) (StreamContext.synchronize)."""
        for ctx in self.resources.streams:
            ctx.wait_limit_s, ctx.wait_over = seconds, renewing

    @property
    def decode_graph_rows(self) -> int:
        graphs = self.resources.bound.context.graphs
        return graphs.batch_sizes[-1] if graphs is not None else 0

    @property
    def prefill_graphs(self) -> bool:
        return self.resources.bound.context.prompt_graphs is not None

    def run_forward(self, forward, batch: ForwardBatch, replayable: bool) -> DeviceTensor:
        """forward(batch) -> logits on the device. Decode steps replay a CUDA graph, and so do replayable forwards
        over longer segments where the stream has prompt graphs. A forward that samples nothing is waited for here
        (sample() waits for the others): once its step returns, its sequences' KV blocks may be freed and handed to
        a sequence on another stream's stream."""
        ctx = self.resources.bound.context
        self.cuda.ensure_current()
        size = ctx.graphs.bucket(batch) if ctx.graphs else None
        if size:
            logits = ctx.graphs.run(forward, batch, size)
        elif replayable and ctx.prompt_graphs is not None and any(n != 1 for n in batch.query_lens):
            logits = ctx.prompt_graphs.run(forward, batch)
        else:
            logits = forward(batch)
        if not len(batch.sample_rows):
            ctx.synchronize()
        return logits

    def stage(self, batch: ForwardBatch) -> None:
        """A decode step's padded metadata, packed for the stream's graph of its bucket."""
        ctx = self.resources.bound.context
        size = ctx.graphs.bucket(batch) if ctx.graphs else None
        if size:
            ctx.graphs.stage(batch, size)

    def run_encoder(self, encode, batch: ForwardBatch, replayable: bool) -> None:
        ctx = self.resources.bound.context
        self.cuda.ensure_current()
        if not replayable or ctx.encoder_graphs is None:
            encode(batch)
        else:
            ctx.encoder_graphs.run(encode, batch)

    def queue_sample(self, logits: DeviceTensor, rows) -> QueuedRows:
        return self.resources.bound.context.sampler.queue(logits, rows)

    def beam_candidates(self, logits: DeviceTensor, banned: list[list[int]], count: int) -> StreamCandidates:
        return self.resources.bound.context.beam_candidates(logits, banned, count)

    def device_search(self, search: SearchStart, forward, layers: list) -> CudaDeviceSearch | None:
        """None where the search exceeds the step kernels' limits (beam_search.fits) or the stream's state region."""
        if not fits(search):
            return None
        ctx = self.resources.bound.context
        seed = seed_of(search, ctx)
        arrays = state_arrays(search, self.resources.shapes.max_blocks_per_seq, seeded=seed is not None)
        if state_bytes(arrays, len(search.tables)) > ctx.beam_state.nbytes:
            return None
        return CudaDeviceSearch(ctx, search, arrays, forward, _paged(layers), ctx.beam_state, seed)

    def copy_block_prefixes(self, layers: list, copies: list[tuple[int, int, int]]) -> None:
        ctx = self.resources.bound.context
        host = np.asarray(copies, dtype=np.int32).reshape(-1, 3)
        if len(host) > ctx.kv_copies.shape[0]:
            raise InvalidArgument(f"{len(host)} KV copies in one step, over the stream's {ctx.kv_copies.shape[0]}")
        rows = DeviceTensor(ctx.kv_copies.ptr, host.shape, "int32")
        ctx.copy_to_device(rows, host)
        kernels.rope_kv.copy_prefixes(self.lib, ctx.stream, _paged(layers), rows, len(host))

    def copy_state_slots(self, layers: list, copies: list[tuple[int, int]]) -> None:
        """Whole state slots of every recurrent layer, (source, destination) each, in one kernel."""
        if not copies:
            return
        if self._states is None:
            raise InvalidArgument("the model keeps no recurrent state to copy")
        ctx = self.resources.bound.context
        host = np.asarray(copies, dtype=np.int32).reshape(-1, 2)
        if host.size > ctx.kv_copies.numel:
            raise InvalidArgument(f"{len(host)} state copies in one step, over the stream's {ctx.kv_copies.numel // 2}")
        rows = DeviceTensor(ctx.kv_copies.ptr, host.shape, "int32")
        ctx.copy_to_device(rows, host)
        kernels.ssm.copy_slots(self.lib, ctx.stream, self._states, rows, len(host))

    def counters(self) -> dict[str, int]:
        return {"kernel_cache_hits": self.lib.cache.hits, "kernel_cache_misses": self.lib.cache.misses,
                "graph_replays": sum(graphs.replays for ctx in self.resources.streams
                                     for graphs in (ctx.graphs, ctx.encoder_graphs, ctx.prompt_graphs)
                                     if graphs is not None)}

    def time_steps(self, enabled: bool) -> None:
        """Benchmarks: events around each round's device work on every stream, from the end of its inputs' upload
        (the forward's first launch or graph replay comes next) to the end of sampling (the one copy back
        excluded); last_device_ms() reads the calling thread's stream's latest round, None when it did not sample."""
        for ctx in self.resources.streams:
            ctx.time_steps(enabled)

    def last_device_ms(self) -> float | None:
        return self.resources.bound.context.last_device_ms()

    def take_rounds(self) -> list[tuple[float, float]]:
        """Benchmarks, with time_steps on: the calling thread's stream's rounds since the last call, each as (its
        device ms, the ms its stream sat idle before it since the round before ended: what the host did not hide)
        (StreamContext.take_rounds)."""
        return self.resources.bound.context.take_rounds()


def _paged(layers: list) -> list[DeviceTensor]:
    """The paged layers' tensors (NoCache layers hold None, recurrent layers a tuple of state tensors)."""
    return [layer for layer in layers if isinstance(layer, DeviceTensor)]
