"""A stack of pre-norm residual blocks whose mixer is, layer by layer, a Mamba2 mixer, an attention without rotary
positions, a ReLU² MLP or a mixture of ReLU² experts: Nemotron-H, and Mamba2 (every block a Mamba2 mixer). The
layer kinds are data (config.layer_kinds), each with its own cache spec: a recurrent state, paged K/V, nothing."""

from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LayerMath, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cache.specs import NoCache, PagedKv
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import mamba2_mixer, moe as mixture
from metrale.runtime.models.attention import packed_attention
from metrale.runtime.models.checkpoint import eos_token_ids, tensor_reader
from metrale.runtime.models.mamba2_mixer import MixerShape
from metrale.runtime.models.moe import MoeConfig, load_moe
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS, attention

LAYER_KINDS = ("mamba", "attention", "mlp", "moe")


@dataclass(frozen=True)
class HybridConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]
    mixer: MixerShape
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # The attention layers' and MLP layers' shapes (0 where the model has none).
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    mlp_bias: bool = False
    moe: MoeConfig | None = None        # the mixture-of-experts layers' shape (where layer_kinds has any)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    hc_mult: int = 0
    is_mla: bool = False

    def __post_init__(self):
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise InvalidArgument(f"{self.architecture}: layer kind(s) {unknown} are not supported (supported: "
                                  f"{', '.join(LAYER_KINDS)})")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def has_ssm(self) -> bool:
        return "mamba" in self.layer_kinds

    @classmethod
    def from_hf(cls, hf: dict, **family) -> "HybridConfig":
        eos = eos_token_ids(hf)
        return cls(architecture=hf["architectures"][0], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   max_position_embeddings=hf.get("max_position_embeddings") or mamba2_mixer.UNLIMITED_POSITIONS_MAX_LEN,
                   tie_word_embeddings=hf.get("tie_word_embeddings", False), eos_token_ids=eos,
                   bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"), **family)


# Tensor parallel (parallel/sharding.py), beside the Mamba2 mixers' (mamba2_mixer.tensor_parallel), the attention's
# (sharding.attention) and the experts' (moe.tensor_parallel): the ReLU² MLP's width by up's output rows and down's
# input columns.
SPLITS = {"up_proj.weight": COLUMNS, "up_proj.bias": COLUMNS, "down_proj.weight": ROWS, "down_proj.bias": ROWS}


def tensor_parallel(config: HybridConfig, shard: Shard) -> tuple[HybridConfig, dict]:
    """A rank's config (its share of the mixers' heads and groups, the attention heads, the MLP and experts' widths,
    where the model has such layers) and the checkpoint's splits."""
    kinds = set(config.layer_kinds)
    mixer, moe, splits = config.mixer, config.moe, dict(SPLITS)
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads
    if "mamba" in kinds:
        mixer, mixer_splits = mamba2_mixer.tensor_parallel(mixer, shard)
        splits.update(mixer_splits)
    if "attention" in kinds:
        num_heads, num_kv_heads, attention_splits = attention(num_heads, num_kv_heads, config.head_dim, shard)
        splits.update(attention_splits)
    if moe:
        moe, experts = mixture.tensor_parallel(moe, shard)
        splits.update(experts)
    return replace(config, mixer=mixer, moe=moe, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   intermediate_size=(shard.divided(config.intermediate_size, "intermediate_size") if "mlp" in kinds
                                      else config.intermediate_size)), splits


class HybridForCausalLM:
    def __init__(self, config: HybridConfig, tensors: dict[str, torch.Tensor], math: LayerMath, max_model_len: int):
        self.config = config
        self.math = math
        self.weights = _load_weights(config, tensors, math)
        if "attention" in config.layer_kinds:
            half = config.head_dim // 2
            self.rope = RopeTable(math.upload_float32(torch.ones(max_model_len, half)),
                                  math.upload_float32(torch.zeros(max_model_len, half)), identity=True)
            self.scale = config.head_dim ** -0.5

    def cache_specs(self) -> tuple:
        c = self.config
        spec = {"mamba": c.mixer.cache_spec(), "attention": PagedKv(c.num_kv_heads, c.head_dim), "mlp": NoCache(),
                "moe": NoCache()}
        return tuple(spec[kind] for kind in c.layer_kinds)

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
            h, residual = ops.rms_norm(x, layer["norm"], c.norm_eps, residual)
            if kind == "mamba":
                x = mamba2_mixer.mixer(ops, h, layer, c.mixer, meta, layer_cache)
            elif kind == "attention":
                x = packed_attention(ops, h, layer, meta, layer_cache, self.rope, c.num_heads, c.num_kv_heads,
                                     c.head_dim, self.scale)
            elif kind == "mlp":
                x = ops.all_reduce(self._mlp(h, layer))
            else:
                shared = self._mlp(h, layer["shared"]) if "shared" in layer else None
                x = ops.all_reduce(ops.moe(h, layer["router"], layer["experts"], shared))
        x, residual = ops.sampled_rows(x, residual, meta)
        x, _ = ops.rms_norm(x, w["norm"], c.norm_eps, residual)
        return ops.logits(x, w["lm_head"])

    def _mlp(self, h, mlp: dict):
        """A ReLU² MLP: a block's, or a mixture's shared experts."""
        ops = self.math
        return ops.linear(ops.relu_squared(ops.linear(h, mlp["up_proj"], mlp.get("up_proj_bias"))),
                          mlp["down_proj"], mlp.get("down_proj_bias"))


def _load_mlp(take, prefix: str, bias: bool, ops: LayerMath) -> dict:
    mlp = {}
    for name in ("up_proj", "down_proj"):
        mlp[name] = ops.upload(take(f"{prefix}{name}.weight"))
        if bias:
            mlp[name + "_bias"] = ops.upload(take(f"{prefix}{name}.bias"))
    return mlp


def _load_weights(c: HybridConfig, tensors: dict[str, torch.Tensor], ops: LayerMath) -> dict:
    # Checkpoints name the stack "backbone." (state-spaces, NVIDIA's own) or "model." (transformers 5).
    prefix = "backbone." if "backbone.embeddings.weight" in tensors else "model."

    take = tensor_reader(tensors, c.architecture)

    if c.tie_word_embeddings:
        embed, lm_head = ops.upload_tied(take(prefix + "embeddings.weight"))
    else:
        embed, lm_head = ops.upload(take(prefix + "embeddings.weight")), ops.upload_lm_head(take("lm_head.weight"))
    layers = []
    for i, kind in enumerate(c.layer_kinds):
        at = f"{prefix}layers.{i}."
        layer = {"norm": ops.upload(take(at + "norm.weight"))}
        if kind == "mamba":
            layer.update(mamba2_mixer.load_mixer(take, at + "mixer.", c.mixer, ops))
        elif kind == "attention":
            layer["qkv_proj"] = ops.upload(torch.cat([take(f"{at}mixer.{p}_proj.weight") for p in "qkv"]))
            layer["o_proj"] = ops.upload(take(at + "mixer.o_proj.weight"))
        elif kind == "mlp":
            layer.update(_load_mlp(take, at + "mixer.", c.mlp_bias, ops))
        else:
            layer.update(load_moe(take, tensors.__contains__, at, c.moe, ops, shared_bias=c.mlp_bias))
        layers.append(layer)
    return {"embed": embed, "lm_head": lm_head, "norm": ops.upload(take(prefix + "norm_f.weight")), "layers": layers}
