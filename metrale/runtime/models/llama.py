"""The Llama family decoder (Llama, and the variants Mistral, Qwen2 and Qwen3 configure, and their mixtures of
experts: Mixtral, Qwen3-MoE, dots.llm1), in layer math."""

from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LayerMath, Linear, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cache.specs import PagedKv
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.checkpoint import KV_SCALE_NAMES, eos_token_ids, kv_scales, tensor_reader
from metrale.runtime.models import moe as mixture
from metrale.runtime.models.moe import MoeConfig, load_moe
from metrale.runtime.models.rope import inverse_frequencies, rope_cos_sin, rope_parameters
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, HEADS, ROWS, attention


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    moe: MoeConfig | None = None        # the layers whose MLP is a mixture of experts, and its shape
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # What Info reports of the architecture: hyper-connection streams (mHC; 0 = none), multi-head latent attention,
    # SSM layers. This family has none of them.
    hc_mult: int = 0
    is_mla: bool = False
    has_ssm: bool = False

    @classmethod
    def from_hf(cls, hf: dict, **family) -> "DecoderConfig":
        if hf.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
        if hf.get("mlp_bias"):
            raise InvalidArgument("mlp_bias=true is not supported")
        eos = eos_token_ids(hf)
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture=hf["architectures"][0], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads, rms_norm_eps=hf["rms_norm_eps"],
            rope=rope_parameters(hf), max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=hf.get("tie_word_embeddings", False), eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"), **family)


# Checkpoint tensors a layer fuses into one weight, in order: one GEMM instead of three or two.
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight")
QK_NORM_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


# Tensor parallel (parallel/sharding.py): the attention by heads (sharding.attention), the MLP's gate and up by output
# rows and its down by input columns, an FP8 KV cache's scales a KV head by heads (every name checkpoint.py's
# kv_scales reads); a mixture's experts and shared experts as the dense MLP (moe.tensor_parallel).
SPLITS = {"gate_proj.weight": COLUMNS, "up_proj.weight": COLUMNS, "down_proj.weight": ROWS,
          **{name: HEADS for names in KV_SCALE_NAMES for name in names}}


def tensor_parallel(config: DecoderConfig, shard: Shard) -> tuple[DecoderConfig, dict[str, str]]:
    """A rank's config (its share of the heads, KV heads, dense MLP width and experts' widths) and the checkpoint's
    splits."""
    heads, kv_heads, splits = attention(config.num_heads, config.num_kv_heads, config.head_dim, shard)
    splits.update(SPLITS)
    moe = config.moe
    if moe:
        moe, experts = mixture.tensor_parallel(moe, shard)
        splits.update(experts)
    dense = not moe or len(moe.layers) < config.num_layers
    local = replace(config, num_heads=heads, num_kv_heads=kv_heads, moe=moe,
                    intermediate_size=(shard.divided(config.intermediate_size, "intermediate_size") if dense
                                       else config.intermediate_size))
    return local, splits


def config_from_hf(hf: dict) -> DecoderConfig:
    """Llama puts attention_bias on all four attention projections."""
    bias = hf.get("attention_bias", False)
    return DecoderConfig.from_hf(hf, qkv_bias=bias, o_bias=bias)


class LlamaForCausalLM:
    def __init__(self, config: DecoderConfig, tensors: dict[str, torch.Tensor], math: LayerMath, max_model_len: int):
        self.config = config
        self.math = math
        self.weights = _load_weights(config, tensors, math)
        self.kv_scales = [kv_scales(tensors, f"model.layers.{i}.self_attn.") for i in range(config.num_layers)]
        cos, sin = rope_cos_sin(inverse_frequencies(config.rope, config.head_dim), max_model_len)
        self.rope = RopeTable(math.upload_float32(cos), math.upload_float32(sin))
        self.scale = config.head_dim ** -0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def cache_specs(self) -> tuple[PagedKv, ...]:
        """Each layer's attention K/V (with the checkpoint's scales for an FP8 cache, where it has them)."""
        return tuple(PagedKv(self.config.num_kv_heads, self.config.head_dim, scales) for scales in self.kv_scales)

    def replayable(self, batch: ForwardBatch) -> bool:
        """The forward reads every batch only through prepare()."""
        return True

    def forward(self, batch: ForwardBatch, kv_cache: list) -> torch.Tensor:
        """Runs every token of the batch; returns logits [N, vocab] of batch.sample_rows."""
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)
        x = ops.embedding(w["embed"], meta.token_ids)             # [T, hidden]
        residual = None
        for layer, kv in zip(w["layers"], kv_cache):
            h, residual = ops.rms_norm(x, layer["input_layernorm.weight"], c.rms_norm_eps, residual)
            h = self._attention(h, layer, meta, kv)
            h, residual = ops.rms_norm(h, layer["post_attention_layernorm.weight"], c.rms_norm_eps, residual)
            x = self._mlp(h, layer)
        x, residual = ops.sampled_rows(x, residual, meta)
        x, _ = ops.rms_norm(x, w["norm"], c.rms_norm_eps, residual)
        return ops.logits(x, w["lm_head"])

    def _mlp(self, h, layer: dict):
        """The dense MLP, or the mixture of experts (plus its shared experts' MLP, where it has them)."""
        ops = self.math
        if "router" not in layer:
            return ops.all_reduce(ops.linear(ops.silu_mul(Linear(h, layer["mlp.gate_up_proj"])),
                                             layer["mlp.down_proj.weight"]))
        shared = None
        if "shared" in layer:
            shared = ops.linear(ops.silu_mul(Linear(h, layer["shared"]["up_proj"])), layer["shared"]["down_proj"])
        return ops.all_reduce(ops.moe(h, layer["router"], layer["experts"], shared))

    def _attention(self, h, layer: dict, meta, kv):
        ops, c = self.math, self.config
        qkv = ops.linear(h, layer["self_attn.qkv_proj"], layer.get("self_attn.qkv_bias"))   # [T, q + 2 kv]
        q, k, v = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size], qkv[:, self.q_size + self.kv_size:]
        if c.qk_norm:
            q = ops.head_rms_norm(q, layer["self_attn.q_norm.weight"], c.rms_norm_eps, c.head_dim)
            k = ops.head_rms_norm(k, layer["self_attn.k_norm.weight"], c.rms_norm_eps, c.head_dim)
        o = ops.self_attention(q, k, v, self.rope, meta, kv, c.num_kv_heads, c.head_dim, self.scale, c.sliding_window)
        return ops.all_reduce(ops.linear(o, layer["self_attn.o_proj.weight"], layer.get("self_attn.o_proj.bias")))


def _load_weights(c: DecoderConfig, tensors: dict[str, torch.Tensor], ops: LayerMath) -> dict:
    take = tensor_reader(tensors, c.architecture)

    if c.tie_word_embeddings:       # one table, laid out as the LM head wants it (its ids index the same rows)
        embed, lm_head = ops.upload_tied(take("model.embed_tokens.weight"))
    else:
        embed, lm_head = ops.upload(take("model.embed_tokens.weight")), ops.upload_lm_head(take("lm_head.weight"))
    layers = []
    moe_layers = set(c.moe.layers) if c.moe else set()
    for i in range(c.num_layers):
        prefix = f"model.layers.{i}."
        layer = {name: ops.upload(take(prefix + name)) for name in LAYER_TENSORS}
        layer["self_attn.qkv_proj"] = ops.upload(torch.cat([take(prefix + p + ".weight") for p in QKV]))
        if i in moe_layers:
            layer.update(load_moe(take, tensors.__contains__, prefix, c.moe, ops))
        else:
            layer["mlp.gate_up_proj"] = ops.upload(torch.cat([take(prefix + p + ".weight") for p in GATE_UP]))
            layer["mlp.down_proj.weight"] = ops.upload(take(prefix + "mlp.down_proj.weight"))
        if c.qkv_bias:
            layer["self_attn.qkv_bias"] = ops.upload(torch.cat([take(prefix + p + ".bias") for p in QKV]))
        if c.o_bias:
            layer["self_attn.o_proj.bias"] = ops.upload(take(prefix + "self_attn.o_proj.bias"))
        if c.qk_norm:
            layer.update({name: ops.upload(take(prefix + name)) for name in QK_NORM_TENSORS})
        layers.append(layer)
    return {"embed": embed, "lm_head": lm_head, "norm": ops.upload(take("model.norm.weight")), "layers": layers}
