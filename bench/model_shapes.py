"""Random bf16 Llama checkpoints of the shapes the GPU benchmarks use, and their byte and FLOP accounting."""

from dataclasses import dataclass

import torch

from metrale.runtime.loading import Checkpoint


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False,
                       rope_theta=500000.0),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152, tied=True,
                          rope_theta=100000.0),
    # For the CPU smoke test.
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, tied=False, rope_theta=10000.0,
                  max_positions=512),
}


# --- the model: a random checkpoint, and what a step must read or compute --------------------------------------

def hf_config(shape: Shape) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab,
            "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
            "tie_word_embeddings": shape.tied, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Hugging Face names -> shapes, as metrale/runtime/models/llama.py takes them."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    shapes = {"model.embed_tokens.weight": (shape.vocab, h), "model.norm.weight": (h,)}
    if not shape.tied:
        shapes["lm_head.weight"] = (shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (shape.ffn, h), p + "mlp.up_proj.weight": (shape.ffn, h),
                       p + "mlp.down_proj.weight": (h, shape.ffn)})
    return shapes


def random_checkpoint(shape: Shape, seed: int = 0, generate_on: str = "cpu") -> Checkpoint:
    """Random bf16 weights in host memory (the engine and the peer both load from host tensors). Matrices
    N(0, 0.02), norm weights 1 + N(0, 0.05): never zeros. generate_on='cuda' draws them on the GPU and copies
    them back, much faster than the CPU's generator for 8B parameters."""
    generator = torch.Generator(device=generate_on).manual_seed(seed)
    tensors = {}
    for name, dims in tensor_shapes(shape).items():
        t = torch.randn(dims, generator=generator, device=generate_on, dtype=torch.bfloat16)
        t = t.mul_(0.05).add_(1.0) if len(dims) == 1 else t.mul_(0.02)
        tensors[name] = t.cpu()
    return Checkpoint(config=hf_config(shape), tensors=tensors, source=f"random bf16 {shape_name(shape)}")


def shape_name(shape: Shape) -> str:
    return next((name for name, s in SHAPES.items() if s == shape), "custom")


def layer_matmul_params(shape: Shape) -> int:
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * shape.ffn


def decode_weight_bytes(shape: Shape) -> int:
    """Bytes of bf16 weights a decode step reads whole: every layer's matrices and norms, the final norm and the
    vocab projection. The embedding table gives one row per token, so it counts only as the tied lm_head."""
    per_layer = layer_matmul_params(shape) + 2 * shape.hidden
    return 2 * (shape.layers * per_layer + shape.hidden + shape.vocab * shape.hidden)


def kv_bytes_per_token(shape: Shape) -> int:
    return 2 * shape.layers * 2 * shape.kv_heads * shape.head_dim   # K and V, bf16, every layer


def prefill_flops(shape: Shape, num_seqs: int, seq_len: int) -> float:
    """Model FLOPs of prefilling num_seqs prompts of seq_len tokens from position 0: 2 x matmul params x tokens
    for the layers, the vocab projection of each prompt's last token only (it is all that is sampled), and causal
    attention (QK^T and PV over t + 1 keys at position t)."""
    tokens = num_seqs * seq_len
    linear = 2 * shape.layers * layer_matmul_params(shape) * tokens + 2 * shape.vocab * shape.hidden * num_seqs
    attention = 2 * shape.layers * shape.heads * shape.head_dim * num_seqs * seq_len * (seq_len + 1)
    return float(linear + attention)


def random_tokens(num_seqs: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """[num_seqs, length] int64 ids above the usual special tokens; the same for the engine and the peer."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num_seqs, length), generator=generator)
