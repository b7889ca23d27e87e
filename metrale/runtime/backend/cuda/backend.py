"""The CUDA backend: the ops of ops.py as NVRTC kernels and cuBLASLt GEMMs on one device stream.

No torch on this path: torch only hands over checkpoint tensors at load time."""

import contextlib
from pathlib import Path

import numpy as np
import torch
from cuda.core import EventOptions

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.batch import CudaBatch, metadata_elements, pack_batch
from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
from metrale.runtime.backend.cuda.device import ALIGNMENT, Arena, CudaDevice, RingArena
from metrale.runtime.backend.cuda.gemm import CublasLt
from metrale.runtime.backend.cuda.graphs import DecodeGraphs
from metrale.runtime.backend.cuda.sampler import OUT_WORDS, DeviceSampler
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.ops import MemoryShapes, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.sampling import SampleResult

GEMM_WORKSPACE_BYTES = 32 << 20
# Penalty lists of one step (distinct history ids of the penalised rows, with counts and biases).
PENALTY_BYTES = 64 << 20
TIMED = EventOptions(timing_enabled=True)
# Linears of at most this many rows with weights of at most this many elements run on the skinny-GEMM kernel:
# on an H200 (bench/gpu_skinny_gemm.py) it beats cuBLASLt by 1.1-1.3x on 6144 x 4096 and 4096 x 4096 and by
# 1.5-1.9x on small matrices at 1 to 8 rows, is even on 4096 x 14336 (0.97-1.01x alone, and in a step cuBLASLt
# adds a split-K reduce kernel there), and trails by ~4% on 4096 x 28672, the 128k-vocab lm_head and 16 rows.
SKINNY_MAX_M = 8
SKINNY_MAX_WEIGHT = 64 << 20
# The activation workspace holds this many layers' tensors at max_batch_tokens (see RingArena).
WORKSPACE_LAYERS = 3


class CudaBackend:
    device = "cuda"
    dtype = torch.bfloat16
    # One stream, one activation workspace and one metadata region so far: lanes take turns.
    concurrent_forwards = False

    def __init__(self, cache_dir: Path, dtype: str = "auto"):
        if dtype not in ("auto", "bfloat16"):
            raise InvalidArgument(f"the CUDA backend runs bfloat16, not {dtype}")
        self.cuda = CudaDevice()
        self.lib = KernelLibrary(self.cuda.arch, KernelCache(cache_dir))
        self._weights: Arena | None = None
        self._pending = []   # host arrays kept alive until the stream is synchronized
        self._prepared: CudaBatch | None = None
        self.graphs: DecodeGraphs | None = None
        self._timing, self._round_events = False, (None, None)

    def plan(self, weight_bytes: int, shapes: MemoryShapes) -> None:
        """Places weights, workspaces and the metadata region; the KV pool takes what is left, later."""
        self.shapes = shapes
        t = shapes.max_batch_tokens
        per_layer = 2 * t * (4 * shapes.hidden + 2 * shapes.q_size + 2 * shapes.kv_size + 3 * shapes.intermediate)
        workspace = WORKSPACE_LAYERS * per_layer + 4 * t * shapes.hidden * 2
        logits = 4 * shapes.max_seqs * shapes.vocab
        metadata = 4 * metadata_elements(t, shapes.max_seqs, shapes.max_blocks_per_seq)
        sample_params = 4 * kernels.sampling.PARAM_WORDS * shapes.max_seqs
        sample_outputs = 4 * OUT_WORDS * shapes.max_seqs
        # Decode attention's per-split partial outputs, for the largest batch and context (not in the ring: their
        # size follows the split count, not max_batch_tokens).
        decode_partials = 4 * kernels.attention.decode_workspace_bound(
            self.lib, min(shapes.max_seqs, t), shapes.q_size // shapes.head_dim, shapes.kv_size // shapes.head_dim,
            shapes.head_dim, shapes.max_blocks_per_seq * shapes.kv_block_size)
        sizes = {"weights": weight_bytes, "workspace": workspace, "logits": logits, "processed": logits,
                 "decode_partials": decode_partials,

                 "metadata": metadata, "gemm": GEMM_WORKSPACE_BYTES, "sample_params": sample_params,
                 "sample_outputs": sample_outputs, "penalties": PENALTY_BYTES}
        aligned = {name: -(-size // ALIGNMENT) * ALIGNMENT for name, size in sizes.items()}
        base = self.cuda.allocate(sum(aligned.values()))
        regions = {}
        for name, size in aligned.items():
            regions[name] = Arena(base, size, name)
            base += size
        self._weights = regions["weights"]
        self._ring = RingArena(regions["workspace"].base, regions["workspace"].nbytes, "activation workspace")
        self._logits = regions["logits"].take((shapes.max_seqs, shapes.vocab), "float32")
        self._metadata = regions["metadata"].take((metadata // 4,), "int32")
        self._decode_partials = regions["decode_partials"].take((max(1, decode_partials // 4),), "float32")
        self.gemm = CublasLt(regions["gemm"].take((GEMM_WORKSPACE_BYTES,), "uint8"))
        self.sampler = DeviceSampler(
            self, regions["sample_params"].take((shapes.max_seqs, kernels.sampling.PARAM_WORDS), "int32"),
            regions["penalties"].take((PENALTY_BYTES // 4,), "int32"),
            regions["processed"].take((shapes.max_seqs, shapes.vocab), "float32"),
            regions["sample_outputs"].take((OUT_WORDS * shapes.max_seqs,), "int32"))

    def upload(self, tensor: torch.Tensor) -> DeviceTensor:
        return self._upload(tensor.to(torch.bfloat16), "bfloat16")

    def upload_float32(self, tensor: torch.Tensor) -> DeviceTensor:
        return self._upload(tensor.float(), "float32")

    def _upload(self, tensor: torch.Tensor, dtype: str) -> DeviceTensor:
        host = tensor.contiguous().view(torch.int16 if dtype == "bfloat16" else torch.float32).numpy()
        out = self._weights.take(tuple(tensor.shape), dtype)
        self.cuda.copy_to_device(out, host)
        self.cuda.synchronize()
        return out

    def available_kv_bytes(self, fraction: float) -> int:
        return int(self.cuda.free_memory() * fraction)

    def allocate_kv_cache(self, num_layers, num_blocks, kv_block_size, num_kv_heads, head_dim):
        shape = (2, num_blocks, kv_block_size, num_kv_heads, head_dim)
        layer_bytes = int(np.prod(shape)) * 2
        pool_bytes = num_layers * -(-layer_bytes // ALIGNMENT) * ALIGNMENT
        pool = Arena(self.cuda.allocate(pool_bytes), pool_bytes, "KV pool")
        return [pool.take(shape, "bfloat16") for _ in range(num_layers)]

    def time_steps(self, enabled: bool) -> None:
        """Benchmarks: events around each round's device work, from the end of its inputs' upload (the forward's
        first launch or graph replay comes next) to the end of sampling (the one copy back excluded);
        last_device_ms() reads the latest round, None when it did not sample."""
        self._timing = enabled
        self._round_events = (None, None)

    def last_device_ms(self) -> float | None:
        started, sampled = self._round_events
        return sampled - started if started is not None and sampled is not None else None

    def mark_sampled(self) -> None:
        """Called by the sampler once its last kernel is queued."""
        if self._timing:
            self._round_events = (self._round_events[0], self.cuda.stream.record(options=TIMED))

    def run_forward(self, forward, batch: ForwardBatch) -> DeviceTensor:
        """forward(batch) -> logits on the device. Decode steps replay a CUDA graph."""
        self.cuda.ensure_current()
        size = self.graphs.bucket(batch) if self.graphs else None
        return self.graphs.run(forward, batch, size) if size else forward(batch)

    def sample(self, logits: DeviceTensor, rows) -> SampleResult:
        result = self.sampler.sample(logits, rows)
        self._pending.clear()
        return result

    def keep_alive(self, host_arrays) -> None:
        """Host arrays an asynchronous copy reads from, kept until the next synchronization."""
        self._pending.append(host_arrays)

    def warm_up(self, forward, batch_sizes: tuple[int, ...], max_context: int) -> None:
        """Captures every decode bucket now, so serving never captures."""
        usable = tuple(b for b in batch_sizes if b <= min(self.shapes.max_seqs, self.shapes.max_batch_tokens))
        self.graphs = DecodeGraphs(self, usable, max_context) if usable else None
        if self.graphs:
            self.graphs.capture_all(forward)

    @contextlib.contextmanager
    def reuse_prepared(self, prepared: CudaBatch):
        """While capturing, the model's prepare() returns the batch already in place instead of copying."""
        self._prepared = prepared
        try:
            yield
        finally:
            self._prepared = None

    def prepare(self, batch: ForwardBatch, pad_to: int = 0) -> CudaBatch:
        """The batch's metadata on the device (pad_to: a decode graph's padded lanes, see pack_batch)."""
        if self._prepared is not None:
            return self._prepared
        lanes = max(pad_to, batch.num_tokens)
        if lanes > self.shapes.max_batch_tokens or max(pad_to, len(batch.sample_rows)) > self.shapes.max_seqs:
            raise InvalidArgument("the forward is larger than the memory plan")
        self._ring.reset()
        prepared = pack_batch(batch, self._metadata, self.shapes.max_blocks_per_seq, pad_to)
        self.cuda.copy_to_device(DeviceTensor(self._metadata.ptr, prepared.host.shape, "int32"), prepared.host)
        self._pending.append(prepared.host)
        if self._timing:
            self._round_events = (self.cuda.stream.record(options=TIMED), None)
        return prepared

    def _new(self, rows: int, cols: int, dtype: str = "bfloat16") -> DeviceTensor:
        return self._ring.take((rows, cols), dtype)

    def embedding(self, table, token_ids):
        out = self._new(token_ids.shape[0], table.shape[1])
        kernels.embedding.embedding(self.lib, self.cuda.stream, out, table, token_ids)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        out = self._new(*x.shape)
        residual_out = self._new(*x.shape)
        kernels.norm.rms_norm(self.lib, self.cuda.stream, out, x, weight, eps, residual=residual,
                              residual_out=residual_out)
        return out, residual_out

    def head_rms_norm(self, x, weight, eps, head_dim):
        kernels.norm.head_rms_norm(self.lib, self.cuda.stream, x, weight, eps, head_dim)
        return x

    def linear(self, x, weight, bias=None):
        out = self._new(x.shape[0], weight.shape[0])
        self._linear(out, x, weight, bias)
        return out

    def _linear(self, out, x, weight, bias=None):
        """Decode-sized linears on the skinny-GEMM kernel where it beats cuBLASLt, the rest on cuBLASLt."""
        if (x.shape[0] <= SKINNY_MAX_M and weight.numel <= SKINNY_MAX_WEIGHT
                and kernels.skinny_gemm.supports(x, weight, out, bias)):
            kernels.skinny_gemm.skinny_linear(self.lib, self.cuda.stream, out, x, weight, bias)
        else:
            self.gemm.linear(self.cuda.stream, out, x, weight, bias)

    def rope_and_write_kv(self, q, k, v, rope: RopeTable, batch: CudaBatch, kv, head_dim):
        # q, k and v are column slices of one qkv buffer, which the kernel takes whole.
        qkv = DeviceTensor(q.ptr, (q.shape[0], q.stride), q.dtype)
        num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
        kernels.rope_kv.rope_and_write_kv(self.lib, self.cuda.stream, qkv, rope.cos, rope.sin, batch.positions,
                                          batch.slot_mapping, kv, num_heads, num_kv_heads, head_dim)
        return q

    def paged_attention(self, q, kv, batch: CudaBatch, num_kv_heads, head_dim, scale, sliding_window):
        out = self._new(q.shape[0], q.shape[1])
        num_heads = q.shape[1] // head_dim
        window = -1 if sliding_window is None else sliding_window
        stream = self.cuda.stream
        if batch.num_decode:
            kernels.attention.paged_decode_attention(
                self.lib, stream, out, q, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
                self._decode_partials, num_heads, num_kv_heads, head_dim, scale, window, batch.max_decode_context)
        if batch.num_prefill:
            kernels.attention.paged_prefill_attention(
                self.lib, stream, out, q, kv, batch.prefill_starts, batch.prefill_lens, batch.prefill_contexts,
                batch.prefill_tables, num_heads, num_kv_heads, head_dim, scale, window, batch.num_prefill,
                batch.max_prefill_query)
        return out

    def silu_mul(self, gate_up):
        out = self._new(gate_up.shape[0], gate_up.shape[1] // 2)
        kernels.activation.silu_mul(self.lib, self.cuda.stream, out, gate_up)
        return out

    def gather_rows(self, x, rows):
        out = self._new(rows.shape[0], x.shape[1], x.dtype)
        kernels.embedding.gather_rows(self.lib, self.cuda.stream, out, x, rows)
        return out

    def logits(self, x, lm_head):
        out = self._logits.rows(0, x.shape[0])
        self._linear(out, x, lm_head)
        return out
