"""Random bf16 checkpoints of the shapes the GPU benchmarks use (Llama, and Nemotron-H's hybrid of Mamba2, attention
and MLP layers), and their byte and FLOP accounting."""

import math
from collections.abc import Mapping
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
    # Llama-3-70B's widths: past one H200 in bf16 with a KV cache beside it, the tensor-parallel shape.
    "llama3-70b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, tied=False,
                        rope_theta=500000.0),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152, tied=True,
                          rope_theta=100000.0),
    # For the CPU smoke test.
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, tied=False, rope_theta=10000.0,
                  max_positions=512),
}


@dataclass(frozen=True)
class HybridShape:
    """A Nemotron-H hybrid: pattern lists its layers (M Mamba2, * attention, - ReLU² MLP)."""
    hidden: int
    pattern: str
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    mamba_heads: int
    mamba_head_dim: int
    state: int
    groups: int
    conv: int = 4
    chunk: int = 128
    max_positions: int = 16384

    def count(self, kind: str) -> int:
        return self.pattern.count(kind)

    @property
    def inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state


HYBRID_SHAPES = {
    "nemotron-h-8b": HybridShape(hidden=4096, pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                                 heads=32, kv_heads=8, head_dim=128, ffn=21504, vocab=131072, mamba_heads=128,
                                 mamba_head_dim=64, state=128, groups=8),
    # For the CPU smoke test.
    "hybrid-tiny": HybridShape(hidden=64, pattern="M*-M-", heads=2, kv_heads=1, head_dim=32, ffn=96, vocab=256,
                               mamba_heads=8, mamba_head_dim=16, state=16, groups=2, chunk=8, max_positions=512),
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


def hybrid_hf_config(shape: HybridShape) -> dict:
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": shape.hidden,
            "hybrid_override_pattern": shape.pattern, "num_hidden_layers": len(shape.pattern),
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "intermediate_size": shape.ffn, "vocab_size": shape.vocab, "mamba_num_heads": shape.mamba_heads,
            "mamba_head_dim": shape.mamba_head_dim, "ssm_state_size": shape.state, "n_groups": shape.groups,
            "conv_kernel": shape.conv, "chunk_size": shape.chunk, "max_position_embeddings": shape.max_positions,
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "use_bias": False, "use_conv_bias": True,
            "mlp_hidden_act": "relu2", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "bfloat16"}


def hybrid_tensor_shapes(shape: HybridShape) -> dict[str, tuple[int, ...]]:
    """Hugging Face names -> shapes, as transformers' NemotronHForCausalLM names them."""
    h, q, kv, inner = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.inner
    shapes = {"model.embeddings.weight": (shape.vocab, h), "model.norm_f.weight": (h,),
              "lm_head.weight": (shape.vocab, h)}
    for i, kind in enumerate(shape.pattern):
        p = f"model.layers.{i}."
        shapes[p + "norm.weight"] = (h,)
        if kind == "M":
            m = p + "mixer."
            shapes.update({m + "in_proj.weight": (inner + shape.conv_channels + shape.mamba_heads, h),
                           m + "conv1d.weight": (shape.conv_channels, 1, shape.conv),
                           m + "conv1d.bias": (shape.conv_channels,), m + "A_log": (shape.mamba_heads,),
                           m + "D": (shape.mamba_heads,), m + "dt_bias": (shape.mamba_heads,),
                           m + "norm.weight": (inner,), m + "out_proj.weight": (h, inner)})
        elif kind == "*":
            shapes.update({p + "mixer.q_proj.weight": (q, h), p + "mixer.k_proj.weight": (kv, h),
                           p + "mixer.v_proj.weight": (kv, h), p + "mixer.o_proj.weight": (h, q)})
        else:
            shapes.update({p + "mixer.up_proj.weight": (shape.ffn, h), p + "mixer.down_proj.weight": (h, shape.ffn)})
    return shapes


def random_checkpoint(shape: "Shape | HybridShape", seed: int = 0, generate_on: str = "cpu") -> Checkpoint:
    """Random bf16 weights in host memory (the engine and the peer both load from host tensors). Matrices
    N(0, 0.02), norm weights 1 + N(0, 0.05): never zeros; a Mamba2 mixer's A_log uniform in [0, 2.5) (per-token
    decays from ~0.3 to ~0.99) and its conv weights N(0, 0.3). generate_on='cuda' draws them on the GPU and copies
    them back, much faster than the CPU's generator for 8B parameters."""
    generator = torch.Generator(device=generate_on).manual_seed(seed)
    tensors = {name: _drawn(name, dims, generator, generate_on) for name, dims in _tensor_shapes(shape).items()}
    return Checkpoint(config=_hf_config(shape), tensors=tensors, source=f"random bf16 {shape_name(shape)}")


def drawn_checkpoint(shape: "Shape | HybridShape", seed: int = 0, generate_on: str = "cpu") -> Checkpoint:
    """random_checkpoint's kind of weights, each tensor drawn only as it is taken (RandomTensors): a tensor-parallel
    rank keeps only its part of each, so no process holds a whole model in host memory, and every rank that draws
    with the same seed draws the same model."""
    return Checkpoint(config=_hf_config(shape), tensors=RandomTensors(_tensor_shapes(shape), seed, generate_on),
                      source=f"random bf16 {shape_name(shape)}, seed {seed}")


class RandomTensors(Mapping):
    """name -> a random tensor of its shape, drawn when taken from a generator of its own (the seed and the name's
    place), so the same tensor comes whatever was taken before it."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, generate_on: str):
        self.shapes, self.seed, self.generate_on = shapes, seed, generate_on
        self.places = {name: i for i, name in enumerate(shapes)}

    def __getitem__(self, name: str) -> torch.Tensor:
        generator = torch.Generator(device=self.generate_on).manual_seed(self.seed * 1_000_003 + self.places[name])
        return _drawn(name, self.shapes[name], generator, self.generate_on)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]


def _drawn(name: str, dims: tuple[int, ...], generator, generate_on: str) -> torch.Tensor:
    """One of random_checkpoint's tensors, in host memory."""
    t = torch.randn(dims, generator=generator, device=generate_on, dtype=torch.bfloat16)
    if name.endswith("A_log"):
        t = torch.rand(dims, generator=generator, device=generate_on, dtype=torch.bfloat16).mul_(2.5)
    elif name.endswith("conv1d.weight"):
        t = t.mul_(0.3)
    else:
        t = t.mul_(0.05).add_(1.0) if len(dims) == 1 else t.mul_(0.02)
    return t.cpu()


def _tensor_shapes(shape: "Shape | HybridShape") -> dict[str, tuple[int, ...]]:
    return hybrid_tensor_shapes(shape) if isinstance(shape, HybridShape) else tensor_shapes(shape)


def _hf_config(shape: "Shape | HybridShape") -> dict:
    return hybrid_hf_config(shape) if isinstance(shape, HybridShape) else hf_config(shape)


def shape_name(shape: "Shape | HybridShape") -> str:
    return next((name for name, s in {**SHAPES, **HYBRID_SHAPES}.items() if s == shape), "custom")


def layer_matmul_params(shape: Shape) -> int:
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * shape.ffn


def decode_weight_bytes(shape: Shape, fp8: bool = False) -> int:
    """Bytes of bf16 weights a decode step reads whole: every layer's matrices and norms, the final norm and the
    vocab projection. The embedding table gives one row per token, so it counts only as the tied lm_head. fp8: the
    layers' matrices in e4m3 with a float32 scale a row (--quantize fp8; the vocab projection stays bf16)."""
    if not fp8:
        per_layer = layer_matmul_params(shape) + 2 * shape.hidden
        return 2 * (shape.layers * per_layer + shape.hidden + shape.vocab * shape.hidden)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    rows = q + 2 * kv + shape.hidden + 2 * shape.ffn + shape.hidden         # qkv, o, gate and up, down
    per_layer = layer_matmul_params(shape) + 4 * rows + 2 * 2 * shape.hidden
    return shape.layers * per_layer + 2 * (shape.hidden + shape.vocab * shape.hidden)


def kv_bytes_per_token(shape: Shape, itemsize: int = 2) -> int:
    """K and V of every layer, bf16 (itemsize 1: --kv-dtype fp8's e4m3)."""
    return itemsize * shape.layers * 2 * shape.kv_heads * shape.head_dim


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


def hybrid_decode_weight_bytes(shape: HybridShape) -> int:
    """As decode_weight_bytes, for a hybrid: every layer's matrices, norms, conv and scan parameters, the final norm
    and the vocab projection (the embedding gives one row per token)."""
    per_token = hybrid_tensor_shapes(shape)
    params = sum(math.prod(dims) for name, dims in per_token.items() if name != "model.embeddings.weight")
    return 2 * params


def hybrid_kv_bytes_per_token(shape: HybridShape) -> int:
    return 2 * shape.count("*") * 2 * shape.kv_heads * shape.head_dim


def hybrid_state_bytes(shape: HybridShape) -> int:
    """A sequence's recurrent state, float32: every Mamba2 layer's conv inputs and scan state."""
    per_layer = shape.conv_channels * (shape.conv - 1) + shape.mamba_heads * shape.mamba_head_dim * shape.state
    return 4 * shape.count("M") * per_layer


def hybrid_prefill_flops(shape: HybridShape, num_seqs: int, seq_len: int) -> float:
    """Model FLOPs of prefilling num_seqs prompts of seq_len tokens: 2 x matmul params x tokens, the vocab projection
    of each prompt's last token, causal attention, and the scan (its state update and read, 4 x heads x head_dim x
    state a token)."""
    tokens = num_seqs * seq_len
    matrices = sum(math.prod(dims) for name, dims in hybrid_tensor_shapes(shape).items()
                   if name.endswith("proj.weight"))
    attention = 2 * shape.count("*") * shape.heads * shape.head_dim * num_seqs * seq_len * (seq_len + 1)
    scan = 4 * shape.count("M") * shape.inner * shape.state * tokens
    return float(2 * matrices * tokens + 2 * shape.vocab * shape.hidden * num_seqs + attention + scan)


def decode_step_bytes(shape: "Shape | HybridShape", batch: int, context: float, fp8: bool = False,
                      kv_itemsize: int = 2) -> float:
    """What a decode step of `batch` sequences holding `context` tokens must move at the least (the floor's bytes):
    the weights read (fp8: decode_weight_bytes'), each sequence's KV read (kv_itemsize bytes a value) and, in a
    hybrid, each sequence's SSM state read and written."""
    if isinstance(shape, HybridShape):
        return hybrid_decode_weight_bytes(shape) + batch * (context * hybrid_kv_bytes_per_token(shape)
                                                            + 2 * hybrid_state_bytes(shape))
    return decode_weight_bytes(shape, fp8) + batch * context * kv_bytes_per_token(shape, kv_itemsize)
