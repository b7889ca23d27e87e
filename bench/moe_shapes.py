"""Mixture-of-experts shapes for the GPU benchmarks (Qwen3-30B-A3B's), their transformers config, and their byte and
FLOP accounting: what a decode step must read depends on which experts its tokens routed to."""

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE decoder: every layer's MLP a mixture of `experts` SwiGLU experts of `width`, top_k a token."""
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


MOE_SHAPES = {
    "qwen3-30b-a3b": MoeShape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                              width=768, vocab=151936),
    # For the CPU smoke test.
    "moe-tiny": MoeShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, width=32,
                         vocab=256, max_positions=512),
}


def hf_config(shape: MoeShape) -> dict:
    """config.json of a Qwen3MoeForCausalLM of this shape (every layer a mixture, normalised top-k)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": shape.hidden,
            "intermediate_size": 3 * shape.width, "moe_intermediate_size": shape.width,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "num_experts": shape.experts,
            "num_experts_per_tok": shape.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "vocab_size": shape.vocab, "max_position_embeddings": shape.max_positions,
            "rms_norm_eps": 1e-6, "rope_theta": shape.rope_theta, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def dense_layer_params(shape: MoeShape) -> int:
    """A layer's parameters every token reads: attention (q, k, v, o and its q/k norms), the two norms, the
    router."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.hidden * (q + 2 * kv) + q * shape.hidden + 2 * shape.head_dim + 2 * shape.hidden \
        + shape.experts * shape.hidden


def expert_bytes(shape: MoeShape) -> int:
    """One expert of one layer, bf16: its gate, up and down projections."""
    return 2 * 3 * shape.width * shape.hidden


def dense_decode_bytes(shape: MoeShape) -> int:
    """What a decode step reads whatever the routing: every layer's dense parameters, the final norm and the vocab
    projection (the embedding gives one row a token)."""
    return 2 * (shape.layers * dense_layer_params(shape) + shape.hidden + shape.vocab * shape.hidden)


def kv_bytes_per_token(shape: MoeShape) -> int:
    return 2 * shape.layers * 2 * shape.kv_heads * shape.head_dim


def total_params(shape: MoeShape) -> int:
    return (shape.layers * (dense_layer_params(shape) + shape.experts * 3 * shape.width * shape.hidden)
            + 2 * shape.vocab * shape.hidden + shape.hidden)


def decode_step_bytes(shape: MoeShape, batch: int, context: float, experts_hit: float) -> float:
    """The floor's bytes of a decode step: the dense weights, the experts its tokens routed to (experts_hit, summed
    over the layers) and every sequence's KV."""
    return dense_decode_bytes(shape) + experts_hit * expert_bytes(shape) + batch * context * kv_bytes_per_token(shape)


def prefill_flops(shape: MoeShape, num_seqs: int, seq_len: int) -> float:
    """Model FLOPs of prefilling num_seqs prompts of seq_len tokens: 2 x the parameters a token uses (attention, the
    router, its top_k experts) a token, causal attention, and the vocab projection of each prompt's last token."""
    tokens = num_seqs * seq_len
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = shape.hidden * (2 * q + 2 * kv) + shape.experts * shape.hidden \
        + shape.top_k * 3 * shape.width * shape.hidden
    attention = 2 * shape.layers * shape.heads * shape.head_dim * num_seqs * seq_len * (seq_len + 1)
    return float(2 * shape.layers * per_token * tokens + attention + 2 * shape.vocab * shape.hidden * num_seqs)
