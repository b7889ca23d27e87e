"""Falcon-H1: in every layer an attention (rotary) and a Mamba2 mixer read the same normed input side by side and
their outputs are summed, then a SwiGLU MLP; µP multipliers throughout, folded into the weights at load (each
multiplies a linear's input or output, or the embedding or LM head)."""

from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LayerMath, Linear, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cache.specs import PagedKv
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import mamba2_mixer
from metrale.runtime.models.attention import packed_attention
from metrale.runtime.models.checkpoint import eos_token_ids, scaled_tied_head_bytes, tensor_reader
from metrale.runtime.models.mamba2_mixer import MixerShape, hf_float
from metrale.runtime.models.rope import inverse_frequencies, rope_cos_sin, rope_parameters
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS, attention


@dataclass(frozen=True)
class FalconH1Config:
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
    mixer: MixerShape
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # The µP multipliers (transformers' names without "_multiplier"); ssm: of in_proj's z, x, B, C and dt.
    embedding: float = 1.0
    lm_head: float = 1.0
    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, ...] = (1.0,) * 5
    mlp: tuple[float, float] = (1.0, 1.0)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    hc_mult: int = 0
    is_mla: bool = False
    has_ssm: bool = True


def config_from_hf(hf: dict) -> FalconH1Config:
    if hf.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
    inner = hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * hidden
    mamba_heads = hf.get("mamba_n_heads", 128)
    mamba_head_dim = hf.get("mamba_d_head", "auto")
    mamba_head_dim = inner // mamba_heads if mamba_head_dim == "auto" else mamba_head_dim
    if mamba_head_dim * mamba_heads != inner:
        raise InvalidArgument(f"mamba_n_heads={mamba_heads} x mamba_d_head={mamba_head_dim} is not the mixer's "
                              f"width {inner}")
    eps = hf.get("rms_norm_eps", 1e-5)
    dt_min, dt_max = (hf_float(v) for v in hf.get("time_step_limit") or (0.0, float("inf")))
    norm = ("before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate") if hf.get("mamba_rms_norm") \
        else "none"
    mixer = MixerShape(hidden_size=hidden, num_heads=mamba_heads, head_dim=mamba_head_dim,
                       state_size=hf.get("mamba_d_state", 256), n_groups=hf.get("mamba_n_groups", 1),
                       conv_kernel=hf.get("mamba_d_conv", 4), chunk_size=hf.get("mamba_chunk_size", 256),
                       norm_eps=eps, in_bias=hf.get("mamba_proj_bias", False),
                       out_bias=hf.get("projectors_bias", False), use_conv_bias=hf.get("mamba_conv_bias", True),
                       dt_min=dt_min, dt_max=dt_max, norm=norm)
    eos = eos_token_ids(hf)
    return FalconH1Config(
        architecture=hf["architectures"][0], vocab_size=hf["vocab_size"], hidden_size=hidden,
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=hf.get("head_dim") or hidden // num_heads,
        rms_norm_eps=eps, rope=rope_parameters(hf), max_position_embeddings=hf.get("max_position_embeddings", 8192),
        mixer=mixer, tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
        embedding=hf.get("embedding_multiplier", 1.0), lm_head=hf.get("lm_head_multiplier", 1.0),
        key=hf.get("key_multiplier", 1.0), attention_in=hf.get("attention_in_multiplier", 1.0),
        attention_out=hf.get("attention_out_multiplier", 1.0), ssm_in=hf.get("ssm_in_multiplier", 1.0),
        ssm_out=hf.get("ssm_out_multiplier", 1.0), ssm=tuple(hf.get("ssm_multipliers") or (1.0,) * 5),
        mlp=tuple(hf.get("mlp_multipliers") or (1.0, 1.0)), eos_token_ids=eos, bos_token_id=hf.get("bos_token_id"),
        pad_token_id=hf.get("pad_token_id"))


# Tensor parallel (parallel/sharding.py): the attention by heads (sharding.attention), the MLP's gate and up by output
# rows with their biases and its down by input columns, the mixer by its heads and groups
# (mamba2_mixer.tensor_parallel); the µP multipliers fold into each rank's part as into the whole.
SPLITS = {**{f"{p}_proj.{t}": COLUMNS for p in ("gate", "up") for t in ("weight", "bias")},
          "down_proj.weight": ROWS, "down_proj.bias": ROWS}


def tensor_parallel(config: FalconH1Config, shard: Shard) -> tuple[FalconH1Config, dict]:
    mixer, splits = mamba2_mixer.tensor_parallel(config.mixer, shard, module="mamba.")
    num_heads, num_kv_heads, attention_splits = attention(config.num_heads, config.num_kv_heads, config.head_dim,
                                                          shard)
    return replace(config, mixer=mixer, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   intermediate_size=shard.divided(config.intermediate_size, "intermediate_size")), \
        {**splits, **attention_splits, **SPLITS}


class FalconH1ForCausalLM:
    # The embedding and the LM head scaled apart, from one table where they are tied.
    extra_weight_bytes = staticmethod(scaled_tied_head_bytes)

    def __init__(self, config: FalconH1Config, tensors: dict[str, torch.Tensor], math: LayerMath, max_model_len: int):
        self.config = config
        self.math = math
        self.weights = _load_weights(config, tensors, math)
        cos, sin = rope_cos_sin(inverse_frequencies(config.rope, config.head_dim), max_model_len)
        self.rope = RopeTable(math.upload_float32(cos), math.upload_float32(sin))
        self.scale = config.head_dim ** -0.5

    def cache_specs(self) -> tuple:
        """Two per layer: its attention's K/V, then its Mamba2 mixer's state."""
        c = self.config
        return (PagedKv(c.num_kv_heads, c.head_dim), c.mixer.cache_spec()) * c.num_layers

    def replayable(self, batch: ForwardBatch) -> bool:
        """The forward reads every batch only through prepare()."""
        return True

    def forward(self, batch: ForwardBatch, cache: list) -> torch.Tensor:
        """Runs every token of the batch; returns logits [N, vocab] of batch.sample_rows."""
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)
        x = ops.embedding(w["embed"], meta.token_ids)             # [T, hidden]
        residual = None
        for i, layer in enumerate(w["layers"]):
            kv, state = cache[2 * i], cache[2 * i + 1]
            h, residual = ops.rms_norm(x, layer["input_layernorm"], c.rms_norm_eps, residual)
            mixed = mamba2_mixer.mixer(ops, h, layer, c.mixer, meta, state)
            x = ops.add(mixed, packed_attention(ops, h, layer, meta, kv, self.rope, c.num_heads, c.num_kv_heads,
                                                c.head_dim, self.scale))
            h, residual = ops.rms_norm(x, layer["pre_ff_layernorm"], c.rms_norm_eps, residual)
            h = ops.silu_mul(Linear(h, layer["gate_up_proj"], layer.get("gate_up_bias")))
            x = ops.all_reduce(ops.linear(h, layer["down_proj"], layer.get("down_bias")))
        x, residual = ops.sampled_rows(x, residual, meta)
        x, _ = ops.rms_norm(x, w["norm"], c.rms_norm_eps, residual)
        return ops.logits(x, w["lm_head"])


def _mixer_in_scale(c: FalconH1Config) -> torch.Tensor:
    """in_proj's output multipliers (transformers' mup_vector: z, x, B, C, dt)."""
    m, inner, groups = c.mixer, c.mixer.inner_size, c.mixer.n_groups * c.mixer.state_size
    sizes = (inner, inner, groups, groups, m.num_heads)
    return torch.cat([torch.full((n,), float(k)) for n, k in zip(sizes, c.ssm)])


def _load_weights(c: FalconH1Config, tensors: dict[str, torch.Tensor], ops: LayerMath) -> dict:
    take = tensor_reader(tensors, c.architecture, as_float=True)

    embed_table = take("model.embed_tokens.weight")
    head = embed_table if c.tie_word_embeddings else take("lm_head.weight")
    in_scale = _mixer_in_scale(c)
    # q, k, v read the normed input times attention_in; k's output is times key; o's output times attention_out.
    qkv_out = [1.0, c.key, 1.0]
    gate_scale, down_scale = c.mlp
    layers = []
    for i in range(c.num_layers):
        at = f"model.layers.{i}."
        layer = {"input_layernorm": ops.upload(take(at + "input_layernorm.weight")),
                 "pre_ff_layernorm": ops.upload(take(at + "pre_ff_layernorm.weight")),
                 "qkv_proj": ops.upload(torch.cat([take(f"{at}self_attn.{p}_proj.weight") * s * c.attention_in
                                                   for p, s in zip("qkv", qkv_out)])),
                 "o_proj": ops.upload(take(at + "self_attn.o_proj.weight") * c.attention_out),
                 "gate_up_proj": ops.upload(torch.cat([take(at + "feed_forward.gate_proj.weight") * gate_scale,
                                                       take(at + "feed_forward.up_proj.weight")])),
                 "down_proj": ops.upload(take(at + "feed_forward.down_proj.weight") * down_scale)}
        if c.attention_bias:
            layer["qkv_bias"] = ops.upload(torch.cat([take(f"{at}self_attn.{p}_proj.bias") * s
                                                      for p, s in zip("qkv", qkv_out)]))
            layer["o_bias"] = ops.upload(take(at + "self_attn.o_proj.bias") * c.attention_out)
        if c.mlp_bias:
            layer["gate_up_bias"] = ops.upload(torch.cat([take(at + "feed_forward.gate_proj.bias") * gate_scale,
                                                          take(at + "feed_forward.up_proj.bias")]))
            layer["down_bias"] = ops.upload(take(at + "feed_forward.down_proj.bias") * down_scale)
        layer.update(mamba2_mixer.load_mixer(take, at + "mamba.", c.mixer, ops, in_scale, c.ssm_in, c.ssm_out))
        layers.append(layer)
    return {"embed": ops.upload(embed_table * c.embedding), "lm_head": ops.upload_lm_head(head * c.lm_head),
            "norm": ops.upload(take("model.final_layernorm.weight")), "layers": layers}
