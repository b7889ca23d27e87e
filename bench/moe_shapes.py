"""Mixture-of-experts shapes for the GPU benchmarks (Qwen3-30B-A3B's, DeepSeek-V2-Lite's, Hy4's), their transformers
config, and their byte and FLOP accounting: what a decode step must read depends on which experts its tokens routed
to (and, with sparse attention, on how many tokens its indexer keeps)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts decoder: a Qwen3-MoE (every layer a mixture of `experts` SwiGLU experts of `width`,
    top_k a token, grouped-query attention of head_dim), or, with kv_lora, a DeepSeek-V2 (multi-head latent
    attention: a latent of kv_lora and a rotary key of rope_dim cached a token; heads of nope_dim + rope_dim query
    and key dims and v_dim value dims; `shared` shared experts beside the routed ones; the first dense_layers
    layers a dense MLP of dense_width)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    width: int
    vocab: int
    rope_theta: float = 1e6
    max_positions: int = 4096
    kv_lora: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    shared: int = 0
    dense_layers: int = 0
    dense_width: int = 0
    # Hy4 (HYV4ForCausalLM, with q_lora): the query's low-rank projection; sparse attention's indexer (index_topk
    # tokens a query, index_heads of index_dim, in the layers of transformers' default indexer_types); hc_mult
    # hyper-connection streams; a sigmoid gate per head; the routed experts' SwiGLU clamp.
    q_lora: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def index_layers(self) -> int:
        """Layers that run an indexer of their own (Hy4's default: the first, then every fourth from the second)."""
        return sum(i == 0 or (i - 1) % 4 == 0 for i in range(self.layers)) if self.index_topk else 0


MOE_SHAPES = {
    "qwen3-30b-a3b": MoeShape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                              width=768, vocab=151936),
    # 27 layers (the first dense), 16 heads of 128 + 64 query-key dims and 128 value dims over a latent of 512,
    # 64 routed experts of 1408 (top-6) and 2 shared.
    "deepseek-v2-lite": MoeShape(hidden=2048, layers=27, heads=16, kv_heads=16, head_dim=192, experts=64, top_k=6,
                                 width=1408, vocab=102400, rope_theta=10000.0, max_positions=16384, kv_lora=512,
                                 nope_dim=128, rope_dim=64, v_dim=128, shared=2, dense_layers=1, dense_width=10944),
    # Hy4 at its published widths, 12 of its 34 layers (to fit one H200): 32 heads of 192 + 64 query-key dims and
    # 256 value dims over a latent of 512, a query rank of 1536; 256 routed experts of 768 (top-8) and 1 shared, the
    # first layer dense; an indexer of 16 heads of 128 keeping 2048 tokens; 4 hyper-connection streams.
    "hy4-12l": MoeShape(hidden=2816, layers=12, heads=32, kv_heads=32, head_dim=256, experts=256, top_k=8, width=768,
                        vocab=120832, rope_theta=10000.0, max_positions=40960, kv_lora=512, nope_dim=192, rope_dim=64,
                        v_dim=256, shared=1, dense_layers=1, dense_width=6912, q_lora=1536, index_heads=16,
                        index_dim=128, index_topk=2048, hc_mult=4),
    # For the CPU smoke tests.
    "moe-tiny": MoeShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, width=32,
                         vocab=256, max_positions=512),
    "mla-tiny": MoeShape(hidden=64, layers=3, heads=2, kv_heads=2, head_dim=32, experts=8, top_k=2, width=32,
                         vocab=256, rope_theta=10000.0, max_positions=512, kv_lora=32, nope_dim=16, rope_dim=16,
                         v_dim=24, shared=1, dense_layers=1, dense_width=96),
    "hy4-tiny": MoeShape(hidden=64, layers=3, heads=2, kv_heads=2, head_dim=32, experts=8, top_k=2, width=32,
                         vocab=256, rope_theta=10000.0, max_positions=512, kv_lora=32, nope_dim=16, rope_dim=16,
                         v_dim=16, shared=1, dense_layers=1, dense_width=96, q_lora=48, index_heads=4, index_dim=32,
                         index_topk=8, hc_mult=2),
}


def hf_config(shape: MoeShape) -> dict:
    """config.json of a model of this shape: Qwen3MoeForCausalLM (every layer a mixture, normalised top-k), or
    DeepseekV2ForCausalLM where the shape has a latent (greedy softmax routing, as V2-Lite's)."""
    common = {"hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_experts_per_tok": shape.top_k, "moe_intermediate_size": shape.width, "vocab_size": shape.vocab,
              "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-6, "rope_theta": shape.rope_theta,
              "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    if shape.hc_mult:
        return {"architectures": ["HYV4ForCausalLM"], "model_type": "hy_v4", **common,
                "intermediate_size": shape.dense_width, "num_key_value_heads": shape.heads,
                "n_routed_experts": shape.experts, "n_shared_experts": shape.shared, "q_lora_rank": shape.q_lora,
                "kv_lora_rank": shape.kv_lora, "qk_nope_head_dim": shape.nope_dim, "qk_rope_head_dim": shape.rope_dim,
                "v_head_dim": shape.v_dim, "index_topk": shape.index_topk, "index_head_dim": shape.index_dim,
                "index_n_heads": shape.index_heads, "hc_mult": shape.hc_mult, "routed_scaling_factor": 2.827,
                "pad_token_id": 0,
                "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta}}
    if shape.kv_lora:
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **common,
                "intermediate_size": shape.dense_width, "num_key_value_heads": shape.heads,
                "n_routed_experts": shape.experts, "n_shared_experts": shape.shared,
                "first_k_dense_replace": shape.dense_layers, "kv_lora_rank": shape.kv_lora, "q_lora_rank": None,
                "qk_nope_head_dim": shape.nope_dim, "qk_rope_head_dim": shape.rope_dim, "v_head_dim": shape.v_dim,
                "topk_method": "greedy", "routed_scaling_factor": 1.0, "norm_topk_prob": False}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
            "intermediate_size": 3 * shape.width, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "num_experts": shape.experts, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def attention_params(shape: MoeShape) -> int:
    """A layer's attention parameters (and its norms): q, k, v, o and the q/k norms; or MLA's query, latent and
    rotary key projection, latent norm, the latent's up-projection (its key and value parts) and o."""
    if shape.kv_lora:
        latent = shape.kv_lora + shape.rope_dim
        heads_qk = shape.heads * (shape.nope_dim + shape.rope_dim)
        query = (shape.hidden * shape.q_lora + shape.q_lora + shape.q_lora * heads_qk if shape.q_lora
                 else shape.hidden * heads_qk)
        params = query + shape.hidden * latent + shape.kv_lora + shape.kv_lora * shape.heads \
            * (shape.nope_dim + shape.v_dim) + shape.heads * shape.v_dim * shape.hidden + 2 * shape.hidden
        if shape.hc_mult:           # Hy4: the gate, its sinks, and two float32 hyper-connections (bf16 units)
            params += shape.hidden * shape.heads * shape.v_dim + 2 * shape.heads \
                + 2 * 2 * 2 * shape.hc_mult * shape.hc_mult * shape.hidden
        return params
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.hidden * (q + 2 * kv) + q * shape.hidden + 2 * shape.head_dim + 2 * shape.hidden


def indexer_params(shape: MoeShape) -> int:
    """A sparse attention indexer's parameters (its float32 head weights in bf16 units): the index query from the
    low-rank query, the index key, its LayerNorm, the heads' weights."""
    if not shape.index_topk:
        return 0
    return shape.q_lora * shape.index_heads * shape.index_dim + shape.hidden * shape.index_dim \
        + 2 * shape.index_dim + 2 * shape.hidden * shape.index_heads


def dense_layer_params(shape: MoeShape) -> int:
    """A mixture layer's parameters every token reads: attention, the router, the shared experts."""
    return attention_params(shape) + shape.experts * shape.hidden + 3 * shape.shared * shape.width * shape.hidden


def expert_bytes(shape: MoeShape, fp8: bool = False) -> int:
    """One expert of one layer, bf16: its gate, up and down projections; fp8: e4m3 with a float32 scale a row."""
    if fp8:
        return 3 * shape.width * shape.hidden + 4 * (2 * shape.width + shape.hidden)
    return 2 * 3 * shape.width * shape.hidden


def require_fp8_floor(shape: MoeShape) -> None:
    """The FP8 floor counts grouped-query attention's mixtures (Qwen3-MoE's): latent attention keeps some of its
    projections bf16, which these counts do not follow."""
    if shape.kv_lora or shape.shared or shape.dense_layers:
        raise ValueError("the FP8 floor is counted for Qwen3-MoE-like shapes (no latent attention, shared experts "
                         "or dense layers)")


def dense_decode_bytes(shape: MoeShape, fp8: bool = False) -> int:
    """What a decode step reads whatever the routing: every mixture layer's dense parameters, every dense layer's
    attention and MLP, the final norm and the vocab projection (the embedding gives one row a token). fp8
    (--quantize fp8, require_fp8_floor's shapes): the attention's projections e4m3 with a float32 scale a row; the
    router, norms and vocab projection bf16."""
    if fp8:
        require_fp8_floor(shape)
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        matrices = shape.hidden * (q + 2 * kv) + q * shape.hidden + 4 * (q + 2 * kv + shape.hidden)
        bf16 = dense_layer_params(shape) - (shape.hidden * (q + 2 * kv) + q * shape.hidden)
        return shape.layers * (matrices + 2 * bf16) + 2 * (shape.hidden + shape.vocab * shape.hidden)
    dense = shape.dense_layers * (attention_params(shape) + 3 * shape.hidden * shape.dense_width)
    indexers = shape.index_layers * indexer_params(shape)
    head = 2 * shape.hc_mult * shape.hc_mult * shape.hidden      # Hy4's float32 hyper-connection head
    return 2 * (shape.moe_layers * dense_layer_params(shape) + dense + indexers + head + shape.hidden
                + shape.vocab * shape.hidden)


def kv_bytes_per_token(shape: MoeShape) -> int:
    """The cache a token takes over every layer, bf16: K and V, or MLA's latent and rotary key (and sparse
    attention's index key in the layers with an indexer)."""
    if shape.kv_lora:
        return 2 * shape.layers * (shape.kv_lora + shape.rope_dim) + 2 * shape.index_layers * shape.index_dim
    return 2 * shape.layers * 2 * shape.kv_heads * shape.head_dim


def cache_read_bytes(shape: MoeShape, batch: int, context: float) -> float:
    """The cache a decode step reads: every sequence's whole cache, or with sparse attention its index keys whole
    and the latents of the index_topk tokens each layer keeps."""
    if not shape.index_topk:
        return batch * context * kv_bytes_per_token(shape)
    latents = 2 * shape.layers * (shape.kv_lora + shape.rope_dim) * min(context, shape.index_topk)
    return batch * (latents + 2 * shape.index_layers * shape.index_dim * context)


def mha_kv_bytes_per_token(shape: MoeShape) -> int:
    """What a plain multi-head cache of the same model would take a token: every head's key and value."""
    if shape.kv_lora:
        return 2 * shape.layers * shape.heads * (shape.nope_dim + shape.rope_dim + shape.v_dim)
    return kv_bytes_per_token(shape)


def total_params(shape: MoeShape) -> int:
    experts = shape.moe_layers * shape.experts * 3 * shape.width * shape.hidden
    dense = shape.dense_layers * (attention_params(shape) + 3 * shape.hidden * shape.dense_width)
    return (shape.moe_layers * dense_layer_params(shape) + dense + experts + 2 * shape.vocab * shape.hidden
            + shape.hidden + shape.index_layers * indexer_params(shape))


def decode_step_bytes(shape: MoeShape, batch: int, context: float, experts_hit: float, fp8: bool = False) -> float:
    """The floor's bytes of a decode step: the dense weights, the experts its tokens routed to (experts_hit, summed
    over the layers) and every sequence's KV (MLA: its latent cache; sparse attention: cache_read_bytes'). fp8: the
    weights as --quantize fp8 keeps them (dense_decode_bytes, expert_bytes)."""
    return (dense_decode_bytes(shape, fp8) + experts_hit * expert_bytes(shape, fp8)
            + cache_read_bytes(shape, batch, context))


def prefill_flops(shape: MoeShape, num_seqs: int, seq_len: int) -> float:
    """Model FLOPs of prefilling num_seqs prompts of seq_len tokens: 2 x the parameters a token uses (attention, the
    router, the shared experts and its top_k experts; a dense layer's MLP) a token, causal attention (MLA's as the
    up-projected heads compute it: query-key and value dims), and the vocab projection of each prompt's last
    token."""
    tokens = num_seqs * seq_len
    moe = dense_layer_params(shape) + shape.top_k * 3 * shape.width * shape.hidden
    dense = attention_params(shape) + 3 * shape.hidden * shape.dense_width
    per_token = shape.moe_layers * moe + shape.dense_layers * dense
    qk, v = (shape.nope_dim + shape.rope_dim, shape.v_dim) if shape.kv_lora else (shape.head_dim, shape.head_dim)
    attention = shape.layers * shape.heads * (qk + v) * num_seqs * seq_len * (seq_len + 1)
    return float(2 * per_token * tokens + attention + 2 * shape.vocab * shape.hidden * num_seqs)
