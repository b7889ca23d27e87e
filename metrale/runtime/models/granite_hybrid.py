"""Granite 4.0-H (GraniteMoeHybridForCausalLM): each layer a Mamba2 mixer or an attention (rotary or without
positions, its own softmax scale), then a SwiGLU MLP (with a mixture of SwiGLU experts beside it where
num_local_experts > 0: softmax over the top-k logits, the same as softmax top-k normalised), each added to the
residual times residual_multiplier; the embedding and logits multipliers and residual_multiplier folded into the
weights at load."""

from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LayerMath, Linear, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cache.specs import PagedKv
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import mamba2_mixer, moe as mixture
from metrale.runtime.models.attention import packed_attention
from metrale.runtime.models.checkpoint import eos_token_ids, scaled_tied_head_bytes, tensor_reader
from metrale.runtime.models.mamba2_mixer import MixerShape, hf_float
from metrale.runtime.models.moe import MoeConfig
from metrale.runtime.models.nemotron_h import KINDS
from metrale.runtime.models.rope import inverse_frequencies, rope_cos_sin, rope_parameters
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import ROWS, Segments, attention


@dataclass(frozen=True)
class GraniteHybridConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_kinds: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict | None             # None: attention without positions
    max_position_embeddings: int
    mixer: MixerShape
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_scale: float = 1.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    moe: MoeConfig | None = None        # the experts beside every layer's MLP (num_local_experts > 0)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    hc_mult: int = 0
    is_mla: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def has_ssm(self) -> bool:
        return "mamba" in self.layer_kinds


def config_from_hf(hf: dict) -> GraniteHybridConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    listed = hf.get("layer_types") or hf.get("layers_block_type") or []
    if not listed or any(kind not in KINDS or KINDS[kind] not in ("mamba", "attention") for kind in listed):
        raise InvalidArgument(f"GraniteMoeHybrid: layer types {listed} are not understood (mamba, attention)")
    hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
    eps = hf.get("rms_norm_eps", 1e-6)
    dt_min, dt_max = (hf_float(v) for v in hf.get("time_step_limit") or (0.0, float("inf")))
    bias = hf.get("mamba_proj_bias", False)
    mixer = MixerShape(hidden_size=hidden, num_heads=hf.get("mamba_n_heads", 128),
                       head_dim=hf.get("mamba_d_head", 64), state_size=hf.get("mamba_d_state", 128),
                       n_groups=hf.get("mamba_n_groups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
                       chunk_size=hf.get("mamba_chunk_size", 256), norm_eps=eps, in_bias=bias, out_bias=bias,
                       use_conv_bias=hf.get("mamba_conv_bias", True), dt_min=dt_min, dt_max=dt_max)
    if mixer.inner_size != hf.get("mamba_expand", 2) * hidden:
        raise InvalidArgument(f"mamba_n_heads x mamba_d_head ({mixer.inner_size}) is not mamba_expand x "
                              f"hidden_size ({hf.get('mamba_expand', 2) * hidden})")
    eos = eos_token_ids(hf)
    experts = hf.get("num_local_experts", 0)
    moe = MoeConfig(num_experts=experts, top_k=hf["num_experts_per_tok"], width=hf["intermediate_size"],
                    layers=tuple(range(len(listed))), module="block_sparse_moe") if experts > 0 else None
    return GraniteHybridConfig(
        architecture=hf["architectures"][0], vocab_size=hf["vocab_size"], hidden_size=hidden,
        intermediate_size=hf["shared_intermediate_size"], layer_kinds=tuple(KINDS[kind] for kind in listed),
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads, rms_norm_eps=eps,
        rope=rope_parameters(hf) if hf.get("position_embedding_type") == "rope" else None,
        max_position_embeddings=hf.get("max_position_embeddings", 4096), mixer=mixer,
        tie_word_embeddings=hf.get("tie_word_embeddings", False), attention_bias=hf.get("attention_bias", False),
        attention_scale=hf.get("attention_multiplier", 1.0), embedding_multiplier=hf.get("embedding_multiplier", 1.0),
        residual_multiplier=hf.get("residual_multiplier", 1.0), logits_scaling=hf.get("logits_scaling", 1.0),
        moe=moe, eos_token_ids=eos, bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"))


def tensor_parallel(config: GraniteHybridConfig, shard: Shard) -> tuple[GraniteHybridConfig, dict]:
    """A rank's config and the checkpoint's splits (parallel/sharding.py): the mixers by their heads and groups
    (mamba2_mixer.tensor_parallel), the attention by heads (q, k, v by output rows with their biases, o by input
    columns), the shared MLP's and the experts' widths (input_linear's gate rows and up rows each by rows,
    output_linear by input columns; each expert's alike, stacked in either naming)."""
    mixer, splits = mamba2_mixer.tensor_parallel(config.mixer, shard, module="mamba.")
    num_heads, num_kv_heads, attention_splits = attention(config.num_heads, config.num_kv_heads, config.head_dim,
                                                          shard)
    width = config.intermediate_size
    splits.update({**attention_splits, "shared_mlp.input_linear.weight": Segments((width, width)),
                   "shared_mlp.output_linear.weight": ROWS})
    moe = config.moe
    if moe:         # its own names of the stacked experts beside transformers 5's (moe.tensor_parallel's)
        splits.update({"block_sparse_moe.input_linear.weight": Segments((moe.width, moe.width), dim=1),
                       "block_sparse_moe.output_linear.weight": ROWS})
        moe, experts = mixture.tensor_parallel(moe, shard)
        splits.update(experts)
    return replace(config, mixer=mixer, moe=moe, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   intermediate_size=shard.divided(width, "shared_intermediate_size")), splits


class GraniteHybridForCausalLM:
    # The embedding and the LM head scaled apart, from one table where they are tied.
    extra_weight_bytes = staticmethod(scaled_tied_head_bytes)

    def __init__(self, config: GraniteHybridConfig, tensors: dict[str, torch.Tensor], math: LayerMath,
                 max_model_len: int):
        self.config = config
        self.math = math
        self.weights = _load_weights(config, tensors, math)
        half = config.head_dim // 2
        if config.rope is None:
            self.rope = RopeTable(math.upload_float32(torch.ones(max_model_len, half)),
                                  math.upload_float32(torch.zeros(max_model_len, half)), identity=True)
        else:
            cos, sin = rope_cos_sin(inverse_frequencies(config.rope, config.head_dim), max_model_len)
            self.rope = RopeTable(math.upload_float32(cos), math.upload_float32(sin))

    def cache_specs(self) -> tuple:
        c = self.config
        return tuple(c.mixer.cache_spec() if kind == "mamba" else PagedKv(c.num_kv_heads, c.head_dim)
                     for kind in c.layer_kinds)

    def replayable(self, batch: ForwardBatch) -> bool:
        """The forward reads every batch only through prepare()."""
        return True

    def forward(self, batch: ForwardBatch, cache: list) -> torch.Tensor:
        """Runs every token of the batch; returns logits [N, vocab] of batch.sample_rows."""
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)
        x = ops.embedding(w["embed"], meta.token_ids)             # [T, hidden]
        residual = None
        for kind, layer, layer_cache in zip(c.layer_kinds, w["layers"], cache):
            h, residual = ops.rms_norm(x, layer["input_layernorm"], c.rms_norm_eps, residual)
            if kind == "mamba":
                x = mamba2_mixer.mixer(ops, h, layer, c.mixer, meta, layer_cache)
            else:
                x = packed_attention(ops, h, layer, meta, layer_cache, self.rope, c.num_heads, c.num_kv_heads,
                                     c.head_dim, c.attention_scale)
            h, residual = ops.rms_norm(x, layer["post_attention_layernorm"], c.rms_norm_eps, residual)
            x = ops.linear(ops.silu_mul(Linear(h, layer["input_linear"])), layer["output_linear"])
            if c.moe:
                x = ops.moe(h, layer["router"], layer["experts"], x)
            x = ops.all_reduce(x)           # a rank's partial sums of the shared MLP (and of the experts)
        x, residual = ops.sampled_rows(x, residual, meta)
        x, _ = ops.rms_norm(x, w["norm"], c.rms_norm_eps, residual)
        return ops.logits(x, w["lm_head"])


def _load_experts(take, has, at: str, moe: MoeConfig, scale: float, ops: LayerMath) -> dict:
    """The router and the experts, stacked in the checkpoint (input_linear [E, 2I, H], gate rows first, and
    output_linear [E, H, I], scaled by residual_multiplier; transformers 5 names them experts.gate_up_proj and
    experts.down_proj, and the router router.weight)."""
    stacked = has(at + "experts.gate_up_proj")
    router = take(at + ("router.weight" if stacked else "router.layer.weight"))
    up = take(at + ("experts.gate_up_proj" if stacked else "input_linear.weight"))
    down = take(at + ("experts.down_proj" if stacked else "output_linear.weight")) * scale
    return {"router": moe.router(ops.upload(router)), "experts": ops.upload_experts(up, down)}


def _load_weights(c: GraniteHybridConfig, tensors: dict[str, torch.Tensor], ops: LayerMath) -> dict:
    take = tensor_reader(tensors, c.architecture, as_float=True)

    table = take("model.embed_tokens.weight")
    head = table if c.tie_word_embeddings else take("lm_head.weight")
    scale = c.residual_multiplier           # of every mixer's and MLP's output, before the residual add
    layers = []
    for i, kind in enumerate(c.layer_kinds):
        at = f"model.layers.{i}."
        layer = {"input_layernorm": ops.upload(take(at + "input_layernorm.weight")),
                 "post_attention_layernorm": ops.upload(take(at + "post_attention_layernorm.weight")),
                 "input_linear": ops.upload(take(at + "shared_mlp.input_linear.weight")),
                 "output_linear": ops.upload(take(at + "shared_mlp.output_linear.weight") * scale)}
        if c.moe:
            layer.update(_load_experts(take, tensors.__contains__, at + "block_sparse_moe.", c.moe, scale, ops))
        if kind == "mamba":
            layer.update(mamba2_mixer.load_mixer(take, at + "mamba.", c.mixer, ops, out_scale=scale))
        else:
            layer["qkv_proj"] = ops.upload(torch.cat([take(f"{at}self_attn.{p}_proj.weight") for p in "qkv"]))
            layer["o_proj"] = ops.upload(take(at + "self_attn.o_proj.weight") * scale)
            if c.attention_bias:
                layer["qkv_bias"] = ops.upload(torch.cat([take(f"{at}self_attn.{p}_proj.bias") for p in "qkv"]))
                layer["o_bias"] = ops.upload(take(at + "self_attn.o_proj.bias") * scale)
        layers.append(layer)
    return {"embed": ops.upload(table * c.embedding_multiplier), "lm_head": ops.upload_lm_head(head / c.logits_scaling),
            "norm": ops.upload(take("model.norm.weight")), "layers": layers}
