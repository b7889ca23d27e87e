"""The CUDA layer math (backend/layer_math.py's interface) as NVRTC kernels and cuBLASLt GEMMs, each on the calling
thread's stream (stream_context.py), so forwards on different streams overlap on the device.

No torch on this path: torch only hands over checkpoint tensors at load time."""

import numpy as np
import torch

from metrale.runtime.backend.cuda import hyper_connection, kernels, latent_prefill, mixture, sparse_selection
from metrale.runtime.backend.cuda.batch import CudaBatch
from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix, device_scales, kept_as_fp8
from metrale.runtime.backend.cuda.resources import CudaResources
from metrale.runtime.backend.cuda.stream_context import StreamContext
from metrale.runtime.backend.cuda.vocab_parts import gathered_logits, head_rows
from metrale.runtime.backend.cuda.linears import gated_fits, k_splits, linear_into, partials
from metrale.runtime.backend.cuda.tensor import DTYPES, DeviceTensor
from metrale.runtime.backend.layer_math import Experts, LatentAttention, Linear, MoeRouter, RopeTable, SsmScan, \
    rope_then_attention
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.errors import InvalidArgument


class CudaLayerMath:
    device = "cuda"
    dtype = torch.bfloat16

    def __init__(self, resources: CudaResources):
        self.resources, self.cuda, self.lib = resources, resources.cuda, resources.lib
        self.collectives, self.shard = resources.collectives, resources.shard       # None, None: one device

    @property
    def stream_context(self) -> StreamContext:
        """The calling thread's stream context."""
        return self.resources.bound.context

    def upload(self, tensor: torch.Tensor) -> DeviceTensor | Fp8Matrix:
        """bf16; an FP8 weight in a form fp8_matrix.py keeps (one scale a row, or a row per 128 columns) as an
        Fp8Matrix."""
        if kept_as_fp8(tensor, self.lib.arch, self.resources.gemm.version):
            scales = device_scales(tensor)
            return Fp8Matrix(self._upload(tensor.data.view(torch.uint8), "float8_e4m3"),
                             self._upload(scales, "float32"), blocks=scales.dim() == tensor.dim())
        return self._upload(tensor.to(torch.bfloat16), "bfloat16")

    def upload_lm_head(self, tensor: torch.Tensor) -> DeviceTensor:
        """The rows this device holds (vocab_parts.head_rows; tensor parallel, its part: logits gathers them)."""
        return self.upload(head_rows(tensor, self.shard))

    def upload_tied(self, table: torch.Tensor) -> tuple[DeviceTensor, DeviceTensor]:
        """The embedding and the LM head of one table: one upload on one device; tensor parallel, the whole table
        (every rank embeds every token) and the rank's part of it."""
        head = self.upload_lm_head(table)
        return (head if self.shard is None else self.upload(table)), head

    def upload_float32(self, tensor: torch.Tensor) -> DeviceTensor:
        return self._upload(tensor.float(), "float32")

    def upload_experts(self, up, down, activation="silu", limit=0.0):
        """A gated mixture's up rows interleaved (kernels/moe.py's interleave_gate_up): the up GEMM's epilogue
        applies the activation."""
        if activation == "silu":
            up = kernels.moe.interleave_gate_up(up)
        return Experts(self.upload(up), self.upload(down), activation, limit)

    def _upload(self, tensor: torch.Tensor, dtype: str) -> DeviceTensor:
        # As the dtype's host copies travel (tensor.DTYPES: numpy has no bf16 or e4m3, so their bits do).
        host = tensor.contiguous().view(getattr(torch, DTYPES[dtype][1].__name__)).numpy()
        out = self.resources.weights.take(tuple(tensor.shape), dtype)
        self.cuda.copy_to_device(out, host, self.cuda.stream)
        self.cuda.stream.sync()
        return out

    def prepare(self, batch: ForwardBatch, cross: bool = False) -> CudaBatch:
        return self.resources.bound.context.prepare(batch, cross=cross)

    def embedding(self, table, token_ids):
        ctx = self.resources.bound.context
        out = ctx.new(token_ids.shape[0], table.shape[1])
        kernels.embedding.embedding(self.lib, ctx.stream, out, table, token_ids)
        return out

    def device_ids(self, ids: torch.Tensor) -> DeviceTensor:
        ctx = self.resources.bound.context
        out = ctx.ring.take((ids.shape[0],), "int32")
        ctx.copy_to_device(out, ids.numpy().astype(np.int32))
        return out

    def fairseq_position_ids(self, batch: CudaBatch, padding_idx: int) -> DeviceTensor:
        ctx = self.resources.bound.context
        out = ctx.ring.take((batch.num_tokens,), "int32")
        kernels.embedding.fairseq_position_ids(self.lib, ctx.stream, out, batch.token_ids, batch.positions,
                                               padding_idx)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        x = self._computed(x)
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        residual_out = ctx.new(*x.shape)
        kernels.norm.rms_norm(self.lib, ctx.stream, out, x, weight, eps, residual=residual, residual_out=residual_out)
        return out, residual_out

    def layer_norm(self, x, weight, bias, eps, residual=None):
        if isinstance(x, Linear):
            return self._linear_layer_norm(x, weight, bias, eps, residual)
        ctx = self.resources.bound.context
        out, residual_out = ctx.new(*x.shape), ctx.new(*x.shape)
        kernels.norm.layer_norm(self.lib, ctx.stream, out, x, weight, bias, eps, residual=residual,
                                residual_out=residual_out)
        return out, residual_out

    def _linear_layer_norm(self, linear: Linear, norm_weight, norm_bias, eps, residual):
        """Decode-sized linears (linears.SPLITS_BY_ROWS; none for the skinny GEMM) as split-K partials that the norm
        sums: a strided batched GEMM of short K slices fills the GPU at few rows where one GEMM's K loop is long (1024
        x 1024 at 64 rows: 3.9 -> 3.0 us), and cuBLASLt's own split-K reduce kernel goes. The partials kernel adds a
        residual: without one, the linear, then the norm."""
        x, weight = linear.x, linear.weight
        m, n = x.shape[0], weight.shape[0]
        splits = k_splits(m, weight)
        if splits == 1 or residual is None:
            return self.layer_norm(self.linear(x, weight, linear.bias), norm_weight, norm_bias, eps, residual)
        ctx = self.resources.bound.context
        summed = partials(self.resources.gemm, ctx, x, weight, splits)
        out, residual_out = ctx.new(m, n), ctx.new(m, n)
        kernels.norm.layer_norm_partials(self.lib, ctx.stream, out, summed, splits, linear.bias, norm_weight,
                                         norm_bias, eps, residual, residual_out)
        return out, residual_out

    def embedding_layer_norm(self, table, token_ids, positions_table, positions, weight, bias, eps):
        ctx, shape = self.resources.bound.context, (token_ids.shape[0], table.shape[1])
        out, residual_out = ctx.new(*shape), ctx.new(*shape)
        kernels.norm.layer_norm_gathered(self.lib, ctx.stream, out, residual_out, table, token_ids, positions_table,
                                         positions, weight, bias, eps)
        return out, residual_out

    def head_rms_norm(self, x, weight, eps, head_dim):
        kernels.norm.head_rms_norm(self.lib, self.resources.bound.context.stream, x, weight, eps, head_dim)
        return x

    def linear(self, x, weight, bias=None):
        ctx = self.resources.bound.context
        out = ctx.new(x.shape[0], weight.shape[0])
        linear_into(self.lib, self.resources.gemm, ctx, out, x, weight, bias)
        return out

    def linear_relu(self, x, weight, bias=None):
        ctx = self.resources.bound.context
        out = ctx.new(x.shape[0], weight.shape[0])
        linear_into(self.lib, self.resources.gemm, ctx, out, x, weight, bias, relu=True)
        return out

    def _computed(self, x):
        """A Linear's value; a tensor as it is."""
        return self.linear(x.x, x.weight, x.bias) if isinstance(x, Linear) else x

    def relu(self, x):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.activation.relu(self.lib, ctx.stream, out, x)
        return out

    def silu_mul(self, gate_up):
        """A Linear [gate; up] at decode rows: the GEMM and the activation in one skinny launch (gated_fits)."""
        ctx = self.resources.bound.context
        if isinstance(gate_up, Linear):
            x, weight = gate_up.x, gate_up.weight
            if gate_up.bias is None and gated_fits(x, weight):
                out = ctx.new(x.shape[0], weight.shape[0] // 2)
                kernels.skinny_gemm.skinny_gated(self.lib, ctx.stream, out, x, weight)
                return out
            gate_up = self._computed(gate_up)
        out = ctx.new(gate_up.shape[0], gate_up.shape[1] // 2)
        kernels.activation.silu_mul(self.lib, ctx.stream, out, gate_up)
        return out

    def relu_squared(self, x):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.activation.relu_squared(self.lib, ctx.stream, out, x)
        return out

    def moe(self, x, router: MoeRouter, experts: Experts, shared=None):
        return mixture.moe(self.lib, self.resources, x, router, experts, shared)

    def ssm_conv(self, x, weight, bias, batch: CudaBatch, conv_state):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.ssm.conv(self.lib, ctx.stream, out, x, weight, bias, conv_state, _states(batch))
        return out

    def ssm_scan(self, xbc, dt, scan: SsmScan, batch: CudaBatch, ssm_state):
        ctx = self.resources.bound.context
        y = ctx.new(xbc.shape[0], scan.inner_size)
        states = _states(batch)
        kernels.ssm.scan(self.lib, ctx.stream, y, xbc, dt, scan.A, scan.D, scan.dt_bias, ssm_state, states.short(),
                         scan.n_groups, scan.dt_min, scan.dt_max)
        long = states.long()
        if long.count:      # prefill segments longer than a chunk: every chunk at once
            slots = kernels.ssm.chunk_slots(xbc.shape[0], long, scan.chunk_size)
            chunk_states = ctx.ring.take((slots, scan.inner_size * scan.state_size), "float32")
            chunk_decays = ctx.ring.take((slots, scan.num_heads), "float32")
            kernels.ssm.chunked_scan(self.lib, ctx.stream, y, xbc, dt, scan.A, scan.D, scan.dt_bias, ssm_state, long,
                                     scan.n_groups, scan.dt_min, scan.dt_max, scan.chunk_size, chunk_states,
                                     chunk_decays)
        return y

    def gated_rms_norm(self, x, gate, weight, eps, group_size, norm_before_gate=False):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.ssm.gated_norm(self.lib, ctx.stream, out, x, gate, weight, eps, group_size, norm_before_gate)
        return out

    def mul_silu(self, x, gate):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.activation.mul_silu(self.lib, ctx.stream, out, x, gate)
        return out

    def mul_sigmoid(self, x, gate):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.activation.mul_sigmoid(self.lib, ctx.stream, out, x, gate)
        return out

    def hyper_widen(self, x, hc_mult):
        return hyper_connection.widen(self.lib, self.resources.bound.context, x, hc_mult)

    def hyper_collapse(self, streams, hc, norm=None):
        return hyper_connection.collapse(self.lib, self.resources.bound.context, streams, hc, norm)

    def hyper_expand(self, out, streams, mix):
        return hyper_connection.expand(self.lib, self.resources.bound.context, out, streams, mix)

    def hyper_boundary(self, out, streams, mix, hc, norm=None):
        return hyper_connection.boundary(self.lib, self.resources.bound.context, out, streams, mix, hc, norm)

    def hyper_head(self, streams, head, norm=None):
        return hyper_connection.head(self.lib, self.resources.bound.context, streams, head, norm)

    def sparse_select(self, q, k, x, indexer, rope, batch: CudaBatch, cache):
        return sparse_selection.select(self.lib, self.resources.bound.context, q, k, x, indexer, rope, batch, cache)

    def add(self, x, y):
        ctx = self.resources.bound.context
        out = ctx.new(*x.shape)
        kernels.activation.add(self.lib, ctx.stream, out, x, y)
        return out

    def write_kv(self, k, v, batch: CudaBatch, kv):
        kernels.rope_kv.write_kv(self.lib, self.resources.bound.context.stream, k, v, batch.slot_mapping, kv)

    def rope_and_write_kv(self, q, k, v, rope: RopeTable, batch: CudaBatch, kv, head_dim):
        # q, k and v are column slices of one qkv buffer, which the kernel takes whole.
        qkv = DeviceTensor(q.ptr, (q.shape[0], q.stride), q.dtype)
        num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
        kernels.rope_kv.rope_and_write_kv(self.lib, self.resources.bound.context.stream, qkv, rope.cos, rope.sin,
                                          batch.positions, batch.slot_mapping, kv, num_heads, num_kv_heads, head_dim)
        return q

    def self_attention(self, q, k, v, rope: RopeTable, batch: CudaBatch, kv, num_kv_heads, head_dim, scale,
                       sliding_window):
        num_heads = q.shape[1] // head_dim
        if batch.num_prefill or num_heads != num_kv_heads or kv.dtype != "bfloat16":     # (an FP8 cache: written first)
            return rope_then_attention(self, q, k, v, rope, batch, kv, num_kv_heads, head_dim, scale, sliding_window)
        # Decode rows of a multi-head model: one kernel rotates and writes each new token and attends it.
        ctx = self.resources.bound.context
        out = ctx.new(q.shape[0], q.shape[1])
        cos, sin = (None, None) if rope.identity else (rope.cos, rope.sin)
        new_tokens = kernels.attention.NewTokens(k, v, cos, sin, batch.positions, batch.slot_mapping)
        kernels.attention.paged_decode_attention(
            self.lib, ctx.stream, out, q, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
            ctx.decode_partials, num_heads, num_kv_heads, head_dim, scale,
            -1 if sliding_window is None else sliding_window, batch.max_decode_context, new_tokens=new_tokens)
        return out

    def latent_attention(self, q, latent, rope_key, mla: LatentAttention, rope: RopeTable, batch: CudaBatch, cache,
                         scale, selection=None, sinks=None):
        """Decode rows in the latent space: k_up folded into each head's query (one strided batched GEMM), the
        rotary parts rotated and each token's row written (one launch), latent_attention.cu's attention split over
        their contexts, then v_up (one GEMM). Prefill rows up-projected (latent_prefill.py), or where that does not
        apply (or the rows attend only to the tokens a sparse selection chose), in the latent space as decode
        rows, each token over its causal context (its selection)."""
        ctx, gemm, la = self.resources.bound.context, self.resources.gemm, kernels.latent_attention
        tokens, heads, nope, rank, rope_dim = q.shape[0], mla.num_heads, mla.nope_dim, mla.kv_lora_rank, mla.rope_dim
        width = mla.cache_width
        rows = DeviceTensor(cache.ptr, (cache.shape[0] * cache.shape[1], width), "bfloat16")
        block_size = cache.shape[1]
        plan = (latent_prefill.plan_for(ctx, batch, mla, block_size)
                if batch.num_prefill and selection is None else None)
        latent_space = batch.num_decode or plan is None     # some rows attend in the latent space
        query = ctx.new(tokens, heads * width)
        if latent_space:
            gemm.head_linear(ctx.stream, query.columns(0, rank), q.columns(0, nope), mla.k_up, nope + rope_dim,
                             width, ctx.gemm_workspace, transposed=True)
        la.rope_and_write(self.lib, ctx.stream, query.columns(rank, width), width, q.columns(nope, nope + rope_dim),
                          nope + rope_dim, latent, rope_key, rope.cos, rope.sin, batch.positions, batch.slot_mapping,
                          rows, heads)
        out = ctx.new(tokens, heads * mla.v_dim)
        if latent_space:
            attended = ctx.new(tokens, heads * rank)
            if batch.num_decode:
                chosen = {}
                if selection is not None:
                    selected, counts = selection.decode(self.lib, ctx, batch)
                    chosen = dict(selected=selected, selected_counts=counts)
                la.decode(self.lib, ctx.stream, attended, query, rows, batch.decode_rows, batch.decode_contexts,
                          batch.decode_tables, None, ctx.decode_partials, heads, block_size, scale,
                          selection.width if selection is not None else batch.max_decode_context, sinks=sinks,
                          **chosen)
            if batch.num_prefill and plan is None:
                max_context = self.resources.shapes.max_blocks_per_seq * block_size
                chosen = {}
                if selection is not None:
                    max_context = selection.width
                    chosen = dict(selected=selection.by_row, selected_counts=selection.counts)
                la.prefill(self.lib, ctx.stream, attended, query, rows, batch.prefill_starts, batch.prefill_lens,
                           batch.prefill_contexts, batch.prefill_tables, heads, block_size, scale, batch.num_prefill,
                           batch.max_prefill_query, max_context, sinks=sinks, **chosen)
            gemm.head_linear(ctx.stream, out.columns(0, mla.v_dim), attended.columns(0, rank), mla.v_up, rank,
                             mla.v_dim, ctx.gemm_workspace)
        if plan is not None:        # the prefill rows, over what v_up wrote there
            if sinks is not None:
                raise InvalidArgument("the up-projected latent prefill has no attention sinks")
            latent_prefill.attend(self.lib, gemm, ctx, batch, plan, out, q, query, rows, mla, scale)
        return out

    def paged_attention(self, q, kv, batch: CudaBatch, num_kv_heads, head_dim, scale, sliding_window, causal=True):
        if isinstance(q, Linear):
            if not causal:
                return self._linear_query_attention(q, kv, batch, num_kv_heads, head_dim, scale, sliding_window)
            q = self._computed(q)
        ctx = self.resources.bound.context
        out = ctx.new(q.shape[0], q.shape[1])
        num_heads = q.shape[1] // head_dim
        window = -1 if sliding_window is None else sliding_window
        if batch.num_decode:
            kernels.attention.paged_decode_attention(
                self.lib, ctx.stream, out, q, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
                ctx.decode_partials, num_heads, num_kv_heads, head_dim, scale, window, batch.max_decode_context)
        if batch.num_prefill:
            kernels.attention.paged_prefill_attention(
                self.lib, ctx.stream, out, q, kv, batch.prefill_starts, batch.prefill_lens, batch.prefill_contexts,
                batch.prefill_tables, num_heads, num_kv_heads, head_dim, scale, window, batch.num_prefill,
                batch.max_prefill_query, causal)
        return out

    def _linear_query_attention(self, query: Linear, kv, batch: CudaBatch, num_kv_heads, head_dim, scale,
                                sliding_window):
        """Non-causal attention (a decoder's cross-attention) of a query not yet computed. Decode rows of a
        multi-head model at the row counts _linear_layer_norm splits at: the query's linear as split-K partials that
        the attention kernel sums with the bias, as _linear_layer_norm hands its norm (for 1024 x 1024 at 64 rows,
        as the out projections went: ~4.9 -> ~3.6 us, not yet timed alone); otherwise the linear, then
        paged_attention."""
        x, weight = query.x, query.weight
        m, n = x.shape[0], weight.shape[0]
        splits = k_splits(m, weight)
        if splits == 1 or batch.num_prefill or not batch.num_decode or n != num_kv_heads * head_dim:
            return self.paged_attention(self.linear(x, weight, query.bias), kv, batch, num_kv_heads, head_dim, scale,
                                        sliding_window, causal=False)
        ctx = self.resources.bound.context
        summed = partials(self.resources.gemm, ctx, x, weight, splits)
        out = ctx.new(m, n)
        kernels.attention.paged_decode_attention(
            self.lib, ctx.stream, out, summed, kv, batch.decode_rows, batch.decode_contexts, batch.decode_tables,
            ctx.decode_partials, num_kv_heads, num_kv_heads, head_dim, scale,
            -1 if sliding_window is None else sliding_window, batch.max_decode_context,
            q_partials=kernels.attention.QueryPartials(splits, query.bias))
        return out

    def sampled_rows(self, x, residual, batch: CudaBatch):
        if batch.samples_every_row:
            return x, residual
        rows = batch.sample_rows
        return self._gather_rows(self._computed(x), rows), self._gather_rows(residual, rows)

    def _gather_rows(self, x, rows):
        ctx = self.resources.bound.context
        out = ctx.new(rows.shape[0], x.shape[1], x.dtype)
        kernels.embedding.gather_rows(self.lib, ctx.stream, out, x, rows)
        return out

    def all_reduce(self, x):
        if self.collectives is None:
            return x
        return self.collectives.all_reduce(self._computed(x), self.resources.bound.context.stream)

    def logits(self, x, lm_head):
        ctx = self.resources.bound.context
        if self.collectives is not None:
            return gathered_logits(self.resources, ctx, x, lm_head)
        out = ctx.logits.rows(0, x.shape[0]).columns(0, lm_head.shape[0])
        linear_into(self.lib, self.resources.gemm, ctx, out, x, lm_head)
        return out.columns(0, self.resources.shapes.vocab)


def _states(batch: CudaBatch) -> "kernels.ssm.Segments":
    """The batch's segments with their state slots; a forward of a recurrent model always has them."""
    if batch.states is None:
        raise InvalidArgument("a recurrent layer's forward without state slots")
    return batch.states
