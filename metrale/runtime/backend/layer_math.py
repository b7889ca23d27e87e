"""The layer math every model family is written against: linears, norms, activations, embeddings, rotary
positions, attention over a layer's cache (dense, or over the tokens a sparse indexer selects), mixtures of experts,
hyper-connections and the state-space scan over a sequence's recurrent state. Each backend implements it (cpu/, cuda/). Models know nothing of graphs, streams, sampling or beam search:
that is the runner's (runner.py)."""

from dataclasses import dataclass
from typing import Any, Protocol

import torch

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
class Linear:
    """x @ weight.T (+ bias), not yet computed: a model hands it to the op that reads it (a norm's x, an attention's
    queries, sampled_rows) where that op is its only reader, and the backend chooses whether to fuse the two (the
    CUDA backend hands split-K partials to the reader at decode row counts) or to compute it first."""
    x: Tensor
    weight: Tensor
    bias: Tensor | None = None


@dataclass(frozen=True)
class SsmScan:
    """A Mamba2 mixer's selective scan, uploaded: per head, A = -exp(A_log), the skip D and dt_bias, all float32
    [num_heads]; dt = clamp(softplus(dt + dt_bias), dt_min, dt_max) at every token (prefill and decode alike, so a
    prompt's split into chunks changes nothing); heads share B and C within each of n_groups groups; the scan runs
    prefills in chunks of chunk_size tokens."""
    A: Tensor
    D: Tensor
    dt_bias: Tensor
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    chunk_size: int
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def inner_size(self) -> int:
        """The scan's width: num_heads * head_dim."""
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MoeRouter:
    """A mixture-of-experts layer's router, uploaded. Each token's expert logits x @ weight.T ([experts, hidden]; in
    x's dtype for softmax routers unless float32_logits, else in float32) become scores: softmax over the experts
    (Mixtral, Qwen3-MoE, DeepSeek-V2) or the sigmoid of each (DeepSeek-V3). The top_k experts are chosen by score
    (+ correction_bias, float32 [experts], where given: the choice only, not the weights), among the topk_group of
    n_group equal groups scored highest (n_group 1: all), a group scored by its two best scores' sum (group_score
    "top2", DeepSeek-V3) or its best (group_score "max", DeepSeek-V2); ties go as torch.topk breaks them on the
    backend's device, as in transformers' run there (on CUDA: the lower expert id). Their weights are their scores,
    divided by their sum where normalize (plus 1e-20 for sigmoid scores, as DeepSeek-V3 divides), times scaling."""
    weight: Tensor
    top_k: int
    scoring: str = "softmax"
    normalize: bool = True
    correction_bias: Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    group_score: str = "top2"
    float32_logits: bool = False

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layer's experts, uploaded: expert e maps x to down[e] @ act(up[e] @ x), down [experts,
    hidden, width]. activation "silu": gated, up [experts, 2 * width, hidden] holds the gate's rows then the up's,
    act = silu(gate) * up (Mixtral, Qwen3-MoE, DeepSeek-V3); "relu2": up [experts, width, hidden], act = max(., 0)^2
    (Nemotron-H). Built by LayerMath.upload_experts: a backend may order up's rows its own way (the CUDA backend
    interleaves the gate's and the up's, for its GEMM's epilogue)."""
    up: Tensor
    down: Tensor
    activation: str = "silu"
    # A gated expert's clamp (Hy4's swiglu_limit): silu(min(gate, limit)) * clamp(up, -limit, limit); 0: none.
    limit: float = 0.0

    @property
    def width(self) -> int:
        return self.down.shape[2]


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's (DeepSeek-V2/V3, MiniCPM3) up-projections of a layer's cached latent, uploaded:
    kv_b_proj [heads * (nope_dim + v_dim), kv_lora_rank] split per head into k_up [heads, nope_dim, kv_lora_rank]
    (head h's keys without position, latent @ k_up[h].T) and v_up [heads, v_dim, kv_lora_rank] (its values). Each
    head's key is that then the rotary key of rope_dim every head shares; the cache holds, per token, the normed
    latent then the rotated rotary key."""
    k_up: Tensor
    v_up: Tensor
    rope_dim: int

    @property
    def num_heads(self) -> int:
        return self.k_up.shape[0]

    @property
    def nope_dim(self) -> int:
        return self.k_up.shape[1]

    @property
    def v_dim(self) -> int:
        return self.v_up.shape[1]

    @property
    def kv_lora_rank(self) -> int:
        return self.k_up.shape[2]

    @property
    def cache_width(self) -> int:
        """A token's cached values: the latent, then the rotary key."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class RmsNorm:
    """An RMSNorm (weight uploaded, eps) that an op applies to its result (as rms_norm would), where it takes one: so
    a backend can fuse the norm into the op that makes its input."""
    weight: Tensor
    eps: float


@dataclass(frozen=True)
class HyperProjection:
    """Weights computed from a token's hyper-connection streams [hc_mult * hidden] (mHC: DeepSeek-V4, Hy4), uploaded,
    float32: the streams flattened and divided by their RMS (norm_eps, no weight), projected by fn [rows, hc_mult *
    hidden] to logits, each logit * scale[i] + base through a sigmoid (+ eps) or a softmax."""
    fn: Tensor
    base: Tensor
    scale: Tensor
    hc_mult: int
    norm_eps: float
    eps: float


@dataclass(frozen=True)
class HyperConnection(HyperProjection):
    """A block's hyper-connection. fn's rows give pre logits (hc_mult), post logits (hc_mult) and, where
    sinkhorn_iters, comb logits (hc_mult^2): pre = sigmoid(logit * scale[0] + base) + eps, whose weighted sum of the
    streams is the block's input; post = post_magnitude * sigmoid(logit * scale[1] + base) + post_eps, the weight of
    the block's output added to each stream; comb (DeepSeek-V4) = softmax(logits * scale[2] + base) + eps over each
    row of an hc_mult x hc_mult matrix, made doubly stochastic by sinkhorn_iters alternations of column and row
    normalisation (each sum + eps), which mixes the streams (stream k <- sum over j of comb[j, k] * stream j) before
    the output is added; without it (Hy4) the streams pass as they are."""
    post_magnitude: float = 2.0
    post_eps: float = 0.0
    sinkhorn_iters: int = 0


@dataclass(frozen=True)
class HyperHead(HyperProjection):
    """The streams collapsed after the last block: weights sigmoid(logit * scale[0] + base) + eps, fn [hc_mult,
    hc_mult * hidden]."""


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek sparse attention's indexer (DeepSeek-V3.2, Hy4), uploaded. A token's index query has num_heads heads
    of head_dim (a linear of the attention's low-rank query), its index key one head_dim vector (LayerNorm'd, cached
    per token); rope_dim of each is rotated (rotate-half), the first rope_dim (rope_first) or the last. A query's
    score of a cached token is sum over heads of w[h] * relu(q[h] . k), w = x @ weights_proj.T (float32 [num_heads,
    hidden]) * num_heads^-0.5 * head_dim^-0.5; each query attends to the topk tokens of its causal context scored
    highest (all of them where it holds no more)."""
    weights_proj: Tensor
    num_heads: int
    head_dim: int
    rope_dim: int
    rope_first: bool
    topk: int

    @property
    def weight_scale(self) -> float:
        return (self.num_heads * self.head_dim) ** -0.5


class PreparedBatch(Protocol):
    """A ForwardBatch as the backend holds it for one forward; models read these fields."""
    token_ids: Tensor          # [T]
    sample_rows: Tensor        # [N]
    # Whether every row becomes logits, in order (a decode step's batch): sampled_rows then gathers nothing.
    samples_every_row: bool


class LayerMath(Protocol):
    device: str
    dtype: torch.dtype

    def upload(self, tensor: torch.Tensor) -> Tensor:
        """A weight in the backend's dtype and memory. A GGUF BlockWeight may stay quantized in a form of the
        backend's (the CPU's QuantizedWeight), which only linear, linear_relu, logits and embedding take."""

    def upload_lm_head(self, tensor: torch.Tensor) -> Tensor:
        """upload() for the LM head [vocab, hidden] (logits() multiplies by it): a backend may pad its rows (at most
        LM_HEAD_PADDING_ROWS more, zeros) for its GEMM; logits() still returns [N, vocab]."""

    def upload_float32(self, tensor: torch.Tensor) -> Tensor:
        """A float32 table (rope cos/sin) in the backend's memory."""

    def upload_tied(self, table: torch.Tensor) -> tuple[Tensor, Tensor]:
        """A table [vocab, hidden] that is both the embedding and the LM head (tied embeddings): (embed, lm_head),
        one upload where the two can share it (upload_lm_head's)."""

    def upload_experts(self, up: torch.Tensor, down: torch.Tensor, activation: str = "silu", limit: float = 0.0
                       ) -> Experts:
        """A mixture's experts, up [experts, 2 * width or width, hidden] (a gated one's gate rows then up rows) and
        down [experts, hidden, width], uploaded as the backend's moe() takes them (limit: Experts')."""

    def prepare(self, batch, cross: bool = False) -> PreparedBatch:
        """Moves a ForwardBatch's metadata to the device once per forward; cross=True: a forward's second batch (its
        ForwardBatch.cross), kept beside the first."""

    def embedding(self, table: Tensor, token_ids: Tensor) -> Tensor:
        """[T] -> [T, hidden]."""

    def device_ids(self, ids: torch.Tensor) -> Tensor:
        """Host int64 ids [T] as an index tensor of this forward for embedding() (a model's own position ids)."""

    def fairseq_position_ids(self, batch: PreparedBatch, padding_idx: int) -> Tensor:
        """M2M100's position ids as transformers counts them, for a batch of one-token segments (decode steps) or
        of segments holding no padding id (an encoder's sources): padding_idx where the token is padding_idx, else
        position + 1 + padding_idx. From the batch's own metadata, so a graph can capture it."""

    def rms_norm(self, x: "Tensor | Linear", weight: Tensor, eps: float, residual: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        """residual = x + residual (or x); returns (rms_norm(residual) * weight, residual)."""

    def layer_norm(self, x: "Tensor | Linear", weight: Tensor, bias: Tensor, eps: float,
                   residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """As rms_norm, with LayerNorm (mean and variance, weight and bias): (norm(x + residual), x + residual)."""

    def embedding_layer_norm(self, table: Tensor, token_ids: Tensor, positions_table: Tensor, positions: Tensor,
                             weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """layer_norm(embedding(table, token_ids), weight, bias, eps, embedding(positions_table, positions)): an
        embedding layer's two lookups and its first norm (the backend may gather the rows in the norm)."""

    def head_rms_norm(self, x: Tensor, weight: Tensor, eps: float, head_dim: int) -> Tensor:
        """RMSNorm over each head_dim slice of x [T, heads * head_dim] (Qwen3 q/k norm)."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [T, in] @ weight[out, in].T (+ bias) -> [T, out]."""

    def linear_relu(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """relu(linear(x, weight, bias)): one GEMM with the activation in its epilogue where the backend can (the
        same values: rounding to bf16 commutes with max(., 0))."""

    def relu(self, x: Tensor) -> Tensor:
        """max(x, 0), elementwise."""

    def silu_mul(self, gate_up: Tensor | Linear) -> Tensor:
        """[T, 2 * I] -> silu(gate) * up, [T, I]. gate_up may be a Linear (its weight [gate; up]), which a backend may
        compute with the activation."""

    def relu_squared(self, x: Tensor) -> Tensor:
        """max(x, 0) ** 2, elementwise (Nemotron-H's MLP)."""

    def moe(self, x: Tensor, router: MoeRouter, experts: Experts, shared: Tensor | None = None) -> Tensor:
        """Each token routed (router) to its top_k experts: sum over them of weight * expert(x) (+ shared, the
        shared experts' output, where given) -> [T, hidden]."""

    def ssm_conv(self, x: Tensor, weight: Tensor, bias: Tensor | None, batch: PreparedBatch, conv_state: Tensor
                 ) -> Tensor:
        """SiLU of the causal depthwise conv1d (weight [C, K]) over each segment's rows of x [T, C], continuing from
        the K - 1 inputs before them: the conv state [slots, C, K - 1] at the segment's source slot (zeros for -1),
        oldest first. Writes the segment's last K - 1 inputs into its destination slot. -> [T, C]."""

    def ssm_scan(self, xbc: Tensor, dt: Tensor, scan: SsmScan, batch: PreparedBatch, ssm_state: Tensor) -> Tensor:
        """The selective scan of each segment's rows, continuing from the state [slots, heads, head_dim, state_size]
        (float32) at its source slot (zeros for -1) and writing the state after its last row into its destination
        slot: xbc [T, conv_size] is the conv's output (x, B, C), dt [T, heads] before its bias; returns
        y = scan(x) + D * x, [T, heads * head_dim]."""

    def gated_rms_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int,
                       norm_before_gate: bool = False) -> Tensor:
        """RMSNorm of x * silu(gate) over each group_size slice, times weight (Mamba2's norm before out_proj;
        float32 inside, the result in x's dtype times weight); norm_before_gate: RMSNorm(x) * weight * silu(gate)
        (float32 to the end)."""

    def mul_silu(self, x: Tensor, gate: Tensor) -> Tensor:
        """x * silu(gate), elementwise (a Mamba2 mixer without its norm)."""

    def mul_sigmoid(self, x: Tensor, gate: Tensor) -> Tensor:
        """x * sigmoid(gate), elementwise (Hy4's gated attention output)."""

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """x + y, elementwise (two mixers' outputs of one layer: Falcon-H1's attention and Mamba2)."""

    def write_kv(self, k: Tensor, v: Tensor, batch: PreparedBatch, kv: Tensor) -> None:
        """K and V rows [T, kv_heads * head_dim] into the paged cache at the batch's slots (no rotation): an
        encoder-decoder's cross-attention K/V."""

    def rope_and_write_kv(self, q: Tensor, k: Tensor, v: Tensor, rope: RopeTable, batch: PreparedBatch, kv: Tensor,
                          head_dim: int) -> Tensor:
        """Rotates q and k (rotate-half layout) at the batch positions, writes k and v into kv at the batch
        slots; returns rotated q [T, heads * head_dim]."""

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor, rope: RopeTable, batch: PreparedBatch, kv: Tensor,
                       num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None) -> Tensor:
        """rope_and_write_kv, then causal paged_attention of the rotated q: the batch's new tokens attending
        their sequences' keys and their own -> [T, heads * head_dim]. A backend may do both in one pass."""

    def paged_attention(self, q: "Tensor | Linear", kv: Tensor, batch: PreparedBatch, num_kv_heads: int,
                        head_dim: int, scale: float, sliding_window: int | None, causal: bool = True) -> Tensor:
        """Attention of each segment's queries over its paged KV -> [T, heads * head_dim]: causal, or (causal=False:
        an encoder's self-attention, a decoder's cross-attention) over all of each segment's context."""

    def sparse_select(self, q: Tensor, k: Tensor, x: Tensor, indexer: SparseIndexer, rope: RopeTable,
                      batch: PreparedBatch, cache: Tensor) -> Any:
        """DSA's choice of tokens: q [T, num_heads * head_dim] and k [T, head_dim] (normed) rotated at the batch
        positions, k written into the indexer cache [blocks, block_size, head_dim] at the batch slots, and each
        token's topk highest-scoring tokens of its causal context (SparseIndexer; x [T, hidden] the weights' input)
        -> a selection latent_attention takes, the backend's own."""

    def latent_attention(self, q: Tensor, latent: Tensor, rope_key: Tensor, mla: LatentAttention, rope: RopeTable,
                         batch: PreparedBatch, cache: Tensor, scale: float, selection: Any = None,
                         sinks: Tensor | None = None) -> Tensor:
        """Multi-head latent attention. q [T, heads * (nope_dim + rope_dim)] (each head's part without position,
        then its rotary part), latent [T, kv_lora_rank] (normed), rope_key [T, rope_dim]: rotates q's rotary parts
        and rope_key (rotate-half) at the batch positions, writes each token's latent and rotated key into cache
        [blocks, block_size, cache_width] at its slot, and returns each head's causal attention over its sequence's
        cached tokens -> [T, heads * v_dim], the keys latent @ k_up[h].T then the rotary key, the values latent @
        v_up[h].T. A backend may attend in the latent space (k_up folded into the query, v_up applied after) or
        up-project the keys and values. selection (sparse_select's): each token attends only to the tokens chosen
        for it. sinks (float32 [heads]): a logit per head in each softmax's denominator that takes no value (Hy4)."""

    def hyper_widen(self, x: Tensor, hc_mult: int) -> Tensor:
        """The embedding's rows [T, hidden] copied into hc_mult streams -> [T, hc_mult * hidden]."""

    def hyper_collapse(self, streams: Tensor, hc: HyperConnection, norm: RmsNorm | None = None
                       ) -> tuple[Tensor, Any]:
        """A block's input from the streams [T, hc_mult * hidden] (HyperConnection's pre), through norm where given
        -> ([T, hidden], the mix: post and comb, the backend's own, for hyper_expand)."""

    def hyper_expand(self, out: Tensor, streams: Tensor, mix: Any) -> Tensor:
        """The streams after a block: each (mixed by comb where the connection has one) plus post[n] times the
        block's output out [T, hidden], in float32, rounded to the streams' dtype."""

    def hyper_boundary(self, out: Tensor, streams: Tensor, mix: Any, hc: HyperConnection,
                       norm: RmsNorm | None = None) -> tuple[Tensor, Tensor, Any]:
        """hyper_expand, then the next block's hyper_collapse (through norm): (streams, its input, its mix). A
        backend may fuse the two (hyper_boundary below is them apart)."""

    def hyper_head(self, streams: Tensor, head: HyperHead, norm: RmsNorm | None = None) -> Tensor:
        """The streams collapsed after the last block, through norm where given -> [T, hidden]."""

    def sampled_rows(self, x: "Tensor | Linear", residual: Tensor, batch: PreparedBatch
                     ) -> tuple["Tensor | Linear", Tensor]:
        """x and residual at the rows that become logits (batch.sample_rows), for the final norm: only those need
        it and the vocab projection. Where every row samples, x may stay a Linear for the norm to fuse."""

    def logits(self, x: Tensor, lm_head: Tensor) -> Tensor:
        """x [N, hidden] @ lm_head[vocab, hidden].T -> [N, vocab] float32. Tensor parallel: each rank's LM head
        holds its part of the vocabulary (upload_lm_head keeps it) and every rank gets the whole row."""

    def all_reduce(self, x: "Tensor | Linear") -> "Tensor | Linear":
        """Tensor parallel: x, a rank's partial sum (the product of a linear split by its input columns, the
        parallel/sharding.py rule), summed over the ranks. On one device x itself (a Linear stays one)."""


def rope_then_attention(math: LayerMath, q: Tensor, k: Tensor, v: Tensor, rope: RopeTable, batch: PreparedBatch,
                        kv: Tensor, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None
                        ) -> Tensor:
    """LayerMath.self_attention as its two ops, rope_and_write_kv then causal paged_attention: a backend's
    self_attention where it has nothing fused for the batch."""
    q = math.rope_and_write_kv(q, k, v, rope, batch, kv, head_dim)
    return math.paged_attention(q, kv, batch, num_kv_heads, head_dim, scale, sliding_window)


def hyper_boundary(math: LayerMath, out: Tensor, streams: Tensor, mix: Any, hc: HyperConnection,
                   norm: RmsNorm | None = None) -> tuple[Tensor, Tensor, Any]:
    """LayerMath.hyper_boundary as its two ops: a backend's where it fuses nothing."""
    streams = math.hyper_expand(out, streams, mix)
    return (streams, *math.hyper_collapse(streams, hc, norm))
