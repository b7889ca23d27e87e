"""Mixture-of-experts shapes for the GPU benchmarks (Qwen3-30B-A3B's), their transformers config, and their byte and
FLOP accounting: what a decode step must read depends on which experts its tokens routed to."""

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

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


MOE_SHAPES = {
    "qwen3-30b-a3b": MoeShape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                              width=768, vocab=151936),
    # 27 layers (the first dense), 16 heads of 128 + 64 query-key dims and 128 value dims over a latent of 512,
    # 64 routed experts of 1408 (top-6) and 2 shared.
    "deepseek-v2-lite": MoeShape(hidden=2048, layers=27, heads=16, kv_heads=16, head_dim=192, experts=64, top_k=6,
                                 width=1408, vocab=102400, rope_theta=10000.0, max_positions=16384, kv_lora=512,
                                 nope_dim=128, rope_dim=64, v_dim=128, shared=2, dense_layers=1, dense_width=10944),
    # For the CPU smoke tests.
    "moe-tiny": MoeShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, width=32,
                         vocab=256, max_positions=512),
    "mla-tiny": MoeShape(hidden=64, layers=3, heads=2, kv_heads=2, head_dim=32, experts=8, top_k=2, width=32,
                         vocab=256, rope_theta=10000.0, max_positions=512, kv_lora=32, nope_dim=16, rope_dim=16,
                         v_dim=24, shared=1, dense_layers=1, dense_width=96),
}


def hf_config(shape: MoeShape) -> dict:
    """config.json of a model of this shape: Qwen3MoeForCausalLM (every layer a mixture, normalised top-k), or
    DeepseekV2ForCausalLM where the shape has a latent (greedy softmax routing, as V2-Lite's)."""
    common = {"hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_experts_per_tok": shape.top_k, "moe_intermediate_size": shape.width, "vocab_size": shape.vocab,
              "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-6, "rope_theta": shape.rope_theta,
              "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
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
        return shape.hidden * shape.heads * (shape.nope_dim + shape.rope_dim) + shape.hidden * latent \
            + shape.kv_lora + shape.kv_lora * shape.heads * (shape.nope_dim + shape.v_dim) \
            + shape.heads * shape.v_dim * shape.hidden + 2 * shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.hidden * (q + 2 * kv) + q * shape.hidden + 2 * shape.head_dim + 2 * shape.hidden


def dense_layer_params(shape: MoeShape) -> int:
    """A mixture layer's parameters every token reads: attention, the router, the shared experts."""
    return attention_params(shape) + shape.experts * shape.hidden + 3 * shape.shared * shape.width * shape.hidden


def expert_bytes(shape: MoeShape) -> int:
    """One expert of one layer, bf16: its gate, up and down projections."""
    return 2 * 3 * shape.width * shape.hidden


def dense_decode_bytes(shape: MoeShape) -> int:
    """What a decode step reads whatever the routing: every mixture layer's dense parameters, every dense layer's
    attention and MLP, the final norm and the vocab projection (the embedding gives one row a token)."""
    dense = shape.dense_layers * (attention_params(shape) + 3 * shape.hidden * shape.dense_width)
    return 2 * (shape.moe_layers * dense_layer_params(shape) + dense + shape.hidden + shape.vocab * shape.hidden)


def kv_bytes_per_token(shape: MoeShape) -> int:
    """The cache a token takes over every layer, bf16: K and V, or MLA's latent and rotary key."""
    if shape.kv_lora:
        return 2 * shape.layers * (shape.kv_lora + shape.rope_dim)
    return 2 * shape.layers * 2 * shape.kv_heads * shape.head_dim


def mha_kv_bytes_per_token(shape: MoeShape) -> int:
    """What a plain multi-head cache of the same model would take a token: every head's key and value."""
    if shape.kv_lora:
        return 2 * shape.layers * shape.heads * (shape.nope_dim + shape.rope_dim + shape.v_dim)
    return kv_bytes_per_token(shape)


def total_params(shape: MoeShape) -> int:
    experts = shape.moe_layers * shape.experts * 3 * shape.width * shape.hidden
    dense = shape.dense_layers * (attention_params(shape) + 3 * shape.hidden * shape.dense_width)
    return (shape.moe_layers * dense_layer_params(shape) + dense + experts + 2 * shape.vocab * shape.hidden
            + shape.hidden)


def decode_step_bytes(shape: MoeShape, batch: int, context: float, experts_hit: float) -> float:
    """The floor's bytes of a decode step: the dense weights, the experts its tokens routed to (experts_hit, summed
    over the layers) and every sequence's KV (MLA: its latent cache)."""
    return dense_decode_bytes(shape) + experts_hit * expert_bytes(shape) + batch * context * kv_bytes_per_token(shape)


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
