"""The CPU backend's layer math (layer_math.py's interface) in plain torch. Development, CI and the embedded
default model."""

import torch
import torch.nn.functional as F

from metrale.runtime.backend.cpu import hyper, moe, sparse, ssm
from metrale.runtime.backend.cpu.fp8_kv import kv_plane, store_kv
from metrale.runtime.backend.cpu.quantized import QuantizedWeight
from metrale.runtime.backend.layer_math import Experts, LatentAttention, Linear, MoeRouter, RopeTable, SsmScan, \
    hyper_boundary, rope_then_attention
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.gguf_blocks import BlockWeight

DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CpuLayerMath:
    """The layer math in torch, in dtype. dequantize: GGUF block weights (BlockWeight) become dtype tensors at upload;
    else they are packed and multiplied as they are (QuantizedWeight), which linear, linear_relu, logits and
    embedding take. group: the ranks of a tensor-parallel worker (parallel/group.py), whose partial sums all_reduce
    adds up and whose LM head parts logits gathers; None: one device."""

    device = "cpu"

    def __init__(self, dtype: str = "auto", dequantize: bool = False, group=None):
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype {dtype!r} is not supported on the CPU backend")
        self.dtype = DTYPES[dtype]
        self.dequantize = dequantize
        self.group = group

    def upload(self, tensor: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        if isinstance(tensor, BlockWeight) and not self.dequantize:
            return QuantizedWeight(tensor)
        return tensor.to(self.dtype).contiguous()

    def upload_lm_head(self, tensor: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        """Tensor parallel: the rank's part of the vocabulary, the last part padded with zero rows (logits drops
        their columns)."""
        if self.group is None:
            return self.upload(tensor)
        shard = self.group.shard
        rows = -(-tensor.shape[0] // shard.size)
        part = tensor[shard.rank * rows:(shard.rank + 1) * rows]
        self.vocab_size = tensor.shape[0]
        return self.upload(F.pad(part, (0, 0, 0, rows - part.shape[0])))

    def upload_tied(self, table):
        head = self.upload_lm_head(table)
        return (head if self.group is None else self.upload(table)), head

    def upload_float32(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float().contiguous()

    def upload_experts(self, up, down, activation="silu", limit=0.0):
        return Experts(self.upload(up), self.upload(down), activation, limit)

    def prepare(self, batch: ForwardBatch, cross: bool = False) -> "CpuBatch":
        return CpuBatch.from_batch(batch)

    def device_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def fairseq_position_ids(self, batch: "CpuBatch", padding_idx: int) -> torch.Tensor:
        return torch.where(batch.token_ids == padding_idx, padding_idx, batch.positions + 1 + padding_idx)

    def embedding(self, table, token_ids):
        if isinstance(table, QuantizedWeight):
            return table.rows(token_ids).to(self.dtype)
        return F.embedding(token_ids, table)

    def rms_norm(self, x, weight, eps, residual=None):
        x = self._computed(x)
        if residual is not None:
            x = x + residual
        return _rms(x, weight, eps), x

    def layer_norm(self, x, weight, bias, eps, residual=None):
        x = self._computed(x)
        if residual is not None:
            x = x + residual
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x

    def embedding_layer_norm(self, table, token_ids, positions_table, positions, weight, bias, eps):
        return self.layer_norm(self.embedding(table, token_ids), weight, bias, eps,
                               self.embedding(positions_table, positions))

    def relu(self, x):
        return F.relu(x)

    def head_rms_norm(self, x, weight, eps, head_dim):
        return _rms(x.view(x.shape[0], -1, head_dim), weight, eps).view(x.shape)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, QuantizedWeight):
            return weight.linear(x, bias)
        return F.linear(x, weight, bias)

    def linear_relu(self, x, weight, bias=None):
        return F.relu(self.linear(x, weight, bias))

    def rope_and_write_kv(self, q, k, v, rope: RopeTable, batch: "CpuBatch", kv, head_dim):
        cos, sin = batch.rope_at_positions(rope)
        q = _rotate(q.view(q.shape[0], -1, head_dim), cos, sin)
        k = _rotate(k.view(k.shape[0], -1, head_dim), cos, sin)
        store_kv(kv, batch.slot_mapping, k, v.view(k.shape))
        return q.reshape(q.shape[0], -1)

    def self_attention(self, q, k, v, rope: RopeTable, batch: "CpuBatch", kv, num_kv_heads, head_dim, scale,
                       sliding_window):
        return rope_then_attention(self, q, k, v, rope, batch, kv, num_kv_heads, head_dim, scale, sliding_window)

    def write_kv(self, k, v, batch: "CpuBatch", kv):
        store_kv(kv, batch.slot_mapping, k.view(k.shape[0], *kv.shape[3:]), v.view(k.shape[0], *kv.shape[3:]))

    def paged_attention(self, q, kv, batch: "CpuBatch", num_kv_heads, head_dim, scale, sliding_window, causal=True):
        q = self._computed(q)
        out = torch.empty_like(q)
        if batch.single_rows.numel():
            # Every one-token segment at once, over KV padded to the longest context.
            keys = kv_plane(kv, 0, batch.single_tables).flatten(1, 2)[:, :batch.single_context]   # [B, C, kvh, hd]
            values = kv_plane(kv, 1, batch.single_tables).flatten(1, 2)[:, :batch.single_context]
            queries = q[batch.single_rows].view(len(batch.single_rows), num_kv_heads, -1, head_dim)
            allowed = batch.single_allowed(sliding_window)                              # [B, C]
            scores = torch.einsum("bkgd,bckd->bkgc", queries.float(), keys.float()) * scale
            scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            attended = torch.einsum("bkgc,bckd->bkgd", probs, values.float()).to(q.dtype)
            out[batch.single_rows] = attended.reshape(len(batch.single_rows), -1)
        for start, n, context, table in batch.multi_segments:
            keys = kv_plane(kv, 0, table).reshape(-1, num_kv_heads, head_dim)[:context]    # [C, kvh, hd]
            values = kv_plane(kv, 1, table).reshape(-1, num_kv_heads, head_dim)[:context]
            queries = q[start:start + n].view(n, num_kv_heads, -1, head_dim)      # [n, kvh, g, hd]
            out[start:start + n] = _attend(queries, keys, values, scale, sliding_window, causal).reshape(n, -1)
        return out

    def silu_mul(self, gate_up):
        gate, up = self._computed(gate_up).chunk(2, dim=-1)
        return F.silu(gate) * up

    def relu_squared(self, x):
        return F.relu(x).square()

    def moe(self, x, router: MoeRouter, experts: Experts, shared=None):
        routed = moe.moe(x, router, experts)
        return routed if shared is None else routed + shared

    def ssm_conv(self, x, weight, bias, batch: "CpuBatch", conv_state):
        return ssm.conv(x, weight, bias, batch, conv_state)

    def ssm_scan(self, xbc, dt, scan: SsmScan, batch: "CpuBatch", ssm_state):
        return ssm.scan(xbc, dt, scan, batch, ssm_state)

    def gated_rms_norm(self, x, gate, weight, eps, group_size, norm_before_gate=False):
        return ssm.gated_rms_norm(x, gate, weight, eps, group_size, norm_before_gate)

    def mul_silu(self, x, gate):
        return x * F.silu(gate)

    def mul_sigmoid(self, x, gate):
        return x * torch.sigmoid(gate)

    def hyper_widen(self, x, hc_mult):
        return x.repeat(1, hc_mult)

    def hyper_collapse(self, streams, hc, norm=None):
        x, mix = hyper.collapse(streams, hc)
        return self._normed(x, norm), mix

    def hyper_expand(self, out, streams, mix):
        return hyper.expand(out, streams, mix)

    def hyper_boundary(self, out, streams, mix, hc, norm=None):
        return hyper_boundary(self, out, streams, mix, hc, norm)

    def hyper_head(self, streams, head, norm=None):
        return self._normed(hyper.head(streams, head), norm)

    @staticmethod
    def _normed(x, norm):
        return x if norm is None else _rms(x, norm.weight, norm.eps)

    def sparse_select(self, q, k, x, indexer, rope, batch: "CpuBatch", cache):
        return sparse.select(q, k, x, indexer, rope, batch, cache, _rotate)

    def add(self, x, y):
        return x + y

    def latent_attention(self, q, latent, rope_key, mla: LatentAttention, rope: RopeTable, batch: "CpuBatch", cache,
                         scale, selection=None, sinks=None):
        """In the latent space: each head's query without position times k_up[h] becomes a query of the latent, so
        every head attends over the cached rows themselves (one key head), and its attended latent times v_up[h]
        is its output."""
        tokens, heads, nope, rank = q.shape[0], mla.num_heads, mla.nope_dim, mla.kv_lora_rank
        cos, sin = batch.rope_at_positions(rope)
        q = q.view(tokens, heads, nope + mla.rope_dim)
        key = _rotate(rope_key.view(tokens, 1, -1), cos, sin).view(tokens, -1)
        cache.view(-1, mla.cache_width)[batch.slot_mapping] = torch.cat([latent, key], dim=-1)
        absorbed = torch.einsum("thn,hnl->thl", q[..., :nope], mla.k_up)
        queries = torch.cat([absorbed, _rotate(q[..., nope:], cos, sin)], dim=-1).float()   # [T, H, width]
        attended = torch.empty(tokens, heads, rank, dtype=torch.float32)
        if batch.single_rows.numel():
            rows = cache[batch.single_tables].flatten(1, 2)[:, :batch.single_context].float()   # [B, C, width]
            scores = torch.einsum("bhw,bcw->bhc", queries[batch.single_rows], rows) * scale
            allowed = batch.single_allowed(None) if selection is None else selection.single
            probs = _softmax(scores.masked_fill(~allowed[:, None, :], float("-inf")), sinks, head_dim=1)
            attended[batch.single_rows] = torch.einsum("bhc,bcl->bhl", probs, rows[..., :rank])
        for i, (start, n, context, table) in enumerate(batch.multi_segments):
            rows = cache[table].reshape(-1, mla.cache_width)[:context].float()                    # [C, width]
            scores = torch.einsum("nhw,cw->hnc", queries[start:start + n], rows) * scale
            allowed = causal_mask(n, context) if selection is None else selection.multi[i]
            probs = _softmax(scores.masked_fill(~allowed, float("-inf")), sinks, head_dim=0)
            attended[start:start + n] = torch.einsum("hnc,cl->nhl", probs, rows[:, :rank])
        out = torch.einsum("thl,hvl->thv", attended.to(q.dtype), mla.v_up)
        return out.reshape(tokens, -1)

    def sampled_rows(self, x, residual, batch: "CpuBatch"):
        rows = batch.sample_rows
        return self._computed(x)[rows], residual[rows]

    def _computed(self, x):
        """A Linear's value; a tensor as it is."""
        return self.linear(x.x, x.weight, x.bias) if isinstance(x, Linear) else x

    def logits(self, x, lm_head):
        logits = self.linear(x, lm_head).float()
        if self.group is None:
            return logits
        return self.group.all_gather(logits)[:, :self.vocab_size]

    def all_reduce(self, x):
        return x if self.group is None else self.group.all_reduce(self._computed(x))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: variance in float32, cast back before the weight.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """Softmax over the last dim, with a sink logit per head (dim head_dim of scores) in the denominator where
    given: exp(s) / (sum exp(s) + exp(sink)), as transformers drops the sink's column after its softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    shape = [1] * scores.dim()
    shape[head_dim] = -1
    sink = sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate-half layout: pairs (i, i + head_dim / 2). x [T, heads, head_dim]; cos/sin [T, 1, head_dim / 2].
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def causal_mask(n: int, context: int) -> torch.Tensor:
    """[n, context] bool: which of a segment's context positions each of its n queries (its last n) sees."""
    return torch.arange(context).unsqueeze(0) <= torch.arange(context - n, context).unsqueeze(1)


def _attend(q, k, v, scale, sliding_window, causal=True):
    """q [n, kvh, g, hd] are the last n positions of k/v [C, kvh, hd]; causal, optionally windowed (or, not causal,
    every query sees every key)."""
    n, context = q.shape[0], k.shape[0]
    allowed = causal_mask(n, context) if causal else torch.ones(n, context, dtype=torch.bool)
    if sliding_window is not None:
        allowed &= torch.arange(context).unsqueeze(0) > torch.arange(context - n, context).unsqueeze(1) - sliding_window
    scores = torch.einsum("nkgd,ckd->kgnc", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("kgnc,ckd->nkgd", probs, v.float()).to(q.dtype)


class CpuBatch:
    """A ForwardBatch with what the CPU ops derive from it once per forward instead of once per layer."""

    def __init__(self, batch: ForwardBatch, single: list[int], multi: list[int]):
        self.token_ids, self.positions = batch.token_ids, batch.positions
        self.slot_mapping, self.sample_rows = batch.slot_mapping, batch.sample_rows
        self.samples_every_row = batch.samples_every_row
        self.single_rows = torch.tensor([batch.query_starts[i] for i in single], dtype=torch.int64)
        contexts = [batch.context_lens[i] for i in single]
        self.single_context = max(contexts, default=0)
        self.single_contexts = torch.tensor(contexts, dtype=torch.int64)
        width = max((len(batch.block_tables[i]) for i in single), default=0)
        # Padding points at block 0: read, then masked out.
        self.single_tables = torch.zeros((len(single), width), dtype=torch.int64)
        for row, i in enumerate(single):
            self.single_tables[row, :len(batch.block_tables[i])] = torch.tensor(batch.block_tables[i])
        self.multi_segments = [(batch.query_starts[i], batch.query_lens[i], batch.context_lens[i],
                                torch.tensor(batch.block_tables[i], dtype=torch.int64)) for i in multi]
        # Models with recurrent layers: the one-token segments' (source, destination) state slots as two tensors,
        # and each longer segment's (start, length, (source, destination)).
        slots = batch.state_slots or []
        self.single_states = tuple(torch.tensor([slots[i][k] for i in single] if slots else [], dtype=torch.int64)
                                   for k in (0, 1))
        self.multi_states = [(batch.query_starts[i], batch.query_lens[i], slots[i]) for i in multi] if slots else []
        self._rope = None
        self._allowed = {}

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> "CpuBatch":
        single = [i for i, n in enumerate(batch.query_lens) if n == 1]
        multi = [i for i, n in enumerate(batch.query_lens) if n != 1]
        return cls(batch, single, multi)

    causal_mask = staticmethod(causal_mask)

    def rope_at_positions(self, rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at each token's position: [T, 1, head_dim // 2] each."""
        if self._rope is None:
            self._rope = (rope.cos[self.positions].unsqueeze(1), rope.sin[self.positions].unsqueeze(1))
        return self._rope

    def single_allowed(self, sliding_window: int | None) -> torch.Tensor:
        """[B, C] which cached positions each one-token segment attends to."""
        if sliding_window not in self._allowed:
            k_pos = torch.arange(self.single_context).unsqueeze(0)
            last = (self.single_contexts - 1).unsqueeze(1)
            allowed = k_pos <= last
            if sliding_window is not None:
                allowed &= k_pos > last - sliding_window
            self._allowed[sliding_window] = allowed
        return self._allowed[sliding_window]
