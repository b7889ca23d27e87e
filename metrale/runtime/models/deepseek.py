"""Multi-head latent attention decoders, in layer math: DeepSeek-V2 (and V2-Lite, without the query's low-rank
projection), DeepSeek-V3 (Kimi-K2's checkpoints too), DeepSeek-V3.2 (V3 with DeepSeek sparse attention: each query
attends to the tokens an indexer chooses, sparse_index.py) and MiniCPM3 (Hy4 builds on them: hy_v4.py). Each layer caches one latent vector a token
(kv_lora_rank values, normed, then the rotary key every head shares) instead of K and V for every head; its MLP is
dense in the first first_k_dense_replace layers and a mixture of experts after (DeepSeek's routers: V2's softmax,
greedy or over groups by their best score; V3's sigmoid with its correction bias), or dense throughout (MiniCPM3).
DeepSeek's rotary dims come in interleaved pairs: their projection rows are reordered at load into the rotate-half
layout the backends rotate (the query's and the key's alike, so their products are unchanged). MiniCPM3's
embedding, residual-branch and logit scalings are folded into the weights. The multi-token-prediction layers a V3
checkpoint may hold (past num_hidden_layers) are not read."""

import math
from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LatentAttention, LayerMath, Linear, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cache.specs import PagedIndexKeys, PagedLatent
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import hyper, moe as mixture, sparse_index
from metrale.runtime.models.fused_linear import fuse, padding_rows
from metrale.runtime.models.checkpoint import eos_token_ids, tensor_reader
from metrale.runtime.models.hyper import HyperConfig
from metrale.runtime.models.moe import MoeConfig, load_moe
from metrale.runtime.models.sparse_index import IndexerConfig
from metrale.runtime.models.rope import attention_factor, inverse_frequencies, rope_cos_sin, rope_parameters, \
    rotate_half_order, yarn_mscale
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS


@dataclass(frozen=True)
class MlaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int              # the dense MLP's
    num_layers: int
    num_heads: int
    q_lora_rank: int                    # 0: the query projected directly (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_interleave: bool               # the rotary dims in interleaved pairs (DeepSeek), or rotate-half (MiniCPM3)
    attention_bias: bool = False        # on q_a_proj (or q_proj), kv_a_proj_with_mqa and o_proj
    moe: MoeConfig | None = None
    embedding_scale: float = 1.0        # MiniCPM3's scale_emb
    residual_scale: float = 1.0         # MiniCPM3's scale_depth / sqrt(num_layers), on each residual branch
    logits_divisor: float = 1.0         # MiniCPM3's hidden_size / dim_model_base, before the LM head
    latent_norm_eps: float = 1e-6       # q_a_layernorm's and kv_a_layernorm's (transformers builds them at its default)
    indexer: IndexerConfig | None = None    # DeepSeek sparse attention's (V3.2, Hy4)
    gated_attention: bool = False       # Hy4: each head's output times sigmoid(x @ gate_proj.T)
    attention_sinks: bool = False       # Hy4: a learned logit per head in each softmax's denominator
    hyper: HyperConfig | None = None    # Hy4's hyper-connections (hy_v4.py)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # What Info reports of the architecture: hyper-connection streams (mHC; 0 = none), multi-head latent attention,
    # SSM layers.
    hc_mult: int = 0
    is_mla: bool = True
    has_ssm: bool = False

    @property
    def head_dim(self) -> int:
        """A head's query and key width (without and with position): what the memory plan counts a head as."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_kv_heads(self) -> int:
        """Keys and values up-projected from the latent have a head for each query head."""
        return self.num_heads

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def config_from_hf(hf: dict) -> MlaConfig:
    architecture = hf["architectures"][0]
    if hf.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    if hf.get("mlp_bias"):
        raise InvalidArgument("mlp_bias=true is not supported")
    num_layers, rope_dim = hf["num_hidden_layers"], hf["qk_rope_head_dim"]
    if rope_dim % 2:
        raise InvalidArgument(f"qk_rope_head_dim {rope_dim} must be even")
    minicpm = architecture == "MiniCPM3ForCausalLM"
    sparse = architecture == "DeepseekV32ForCausalLM"
    if sparse and not hf.get("q_lora_rank"):
        raise InvalidArgument("DeepSeek-V3.2's indexer reads the query's low-rank projection: q_lora_rank must be set")
    family = {}
    if minicpm:
        depth = hf.get("scale_depth")
        family = dict(embedding_scale=float(hf.get("scale_emb", 1.0)),
                      residual_scale=(math.sqrt(num_layers) if depth is None else depth) / math.sqrt(num_layers),
                      logits_divisor=hf["hidden_size"] / (hf.get("dim_model_base") or hf["hidden_size"]))
    else:
        family = dict(moe=_moe(hf, architecture))
    if sparse:      # the indexer's key LayerNorm at nn.LayerNorm's eps, its rotary dims first and rotate-half
        family["indexer"] = sparse_index.indexer_config(hf, rope_first=True, rope_interleave=False, norm_eps=1e-6)
    return MlaConfig(
        architecture=architecture, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=num_layers, num_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=rope_dim,
        v_head_dim=hf.get("v_head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rms_norm_eps=hf["rms_norm_eps"], rope=rope_parameters(hf),
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=hf.get("tie_word_embeddings", minicpm),
        rope_interleave=not minicpm and hf.get("rope_interleave", True),
        attention_bias=hf.get("attention_bias", False), eos_token_ids=eos_token_ids(hf),
        bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"), **family)


def _moe(hf: dict, architecture: str) -> MoeConfig | None:
    """DeepSeek's mixture after the first first_k_dense_replace layers (none where the config has no experts)."""
    experts = hf.get("n_routed_experts")
    if not experts:
        return None
    width = hf["moe_intermediate_size"]
    common = dict(num_experts=experts, top_k=hf["num_experts_per_tok"], width=width, layers=moe_layers(hf),
                  scaling=hf.get("routed_scaling_factor", 1.0), shared_width=width * (hf.get("n_shared_experts") or 0))
    if architecture in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):
        return MoeConfig(**common, scoring="sigmoid", normalize=hf.get("norm_topk_prob", True), correction_bias=True,
                         n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1)
    # DeepSeek-V2: softmax over float32 logits, its top-k weights unnormalised (transformers reads no norm_topk_prob).
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise InvalidArgument(f"topk_method {method!r} is not supported (greedy, group_limited_greedy are)")
    grouped = method == "group_limited_greedy"
    return MoeConfig(**common, scoring="softmax", normalize=False, float32_logits=True, group_score="max",
                     n_group=(hf.get("n_group") or 1) if grouped else 1,
                     topk_group=(hf.get("topk_group") or 1) if grouped else 1)


def moe_layers(hf: dict) -> tuple[int, ...]:
    """The layers whose MLP is the mixture: mlp_layer_types' "sparse" ones where the config lists them, else those
    from first_k_dense_replace on."""
    kinds = hf.get("mlp_layer_types")
    if kinds:
        if len(kinds) != hf["num_hidden_layers"] or set(kinds) - {"dense", "sparse"}:
            raise InvalidArgument(f"mlp_layer_types {kinds} must give 'dense' or 'sparse' for each layer")
        return tuple(i for i, kind in enumerate(kinds) if kind == "sparse")
    return tuple(range(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]))


# Tensor parallel (parallel/sharding.py), by query heads as serving engines split latent attention: each rank up-
# projects its heads' queries, keys and values from the latent (q_proj or q_b_proj, kv_b_proj by output rows), gates
# them and adds their sinks (Hy4), and multiplies its heads' outputs by its columns of o_proj; the low-rank query
# (q_a_proj) and the latent (kv_a_proj_with_mqa) stay whole, so every rank caches the whole latent, and the sparse
# attention's indexer stays whole, so every rank chooses the same tokens. The MLPs and experts split as the Llama
# family's.
SPLITS = {"q_proj.weight": COLUMNS, "q_b_proj.weight": COLUMNS, "kv_b_proj.weight": COLUMNS, "o_proj.weight": ROWS,
          "o_proj.bias": ROWS, "self_attn.sinks": COLUMNS, "gate_proj.weight": COLUMNS, "up_proj.weight": COLUMNS,
          "down_proj.weight": ROWS}


def tensor_parallel(config: MlaConfig, shard: Shard) -> tuple[MlaConfig, dict]:
    """A rank's config (its share of the heads, the dense MLP's width where a layer has one, the experts' widths)
    and the checkpoint's splits."""
    moe, splits = config.moe, dict(SPLITS)
    if moe:
        moe, experts = mixture.tensor_parallel(moe, shard)
        splits.update(experts)
    dense = not moe or len(moe.layers) < config.num_layers
    return replace(config, num_heads=shard.divided(config.num_heads, "num_attention_heads"), moe=moe,
                   intermediate_size=(shard.divided(config.intermediate_size, "intermediate_size") if dense
                                      else config.intermediate_size)), splits


class DeepseekForCausalLM:
    def __init__(self, config: MlaConfig, tensors: dict[str, torch.Tensor], math: LayerMath, max_model_len: int):
        self.config = config
        self.math = math
        self.weights = _load_weights(config, tensors, math)
        rope_dim = config.qk_rope_head_dim
        cos, sin = rope_cos_sin(inverse_frequencies(config.rope, rope_dim), max_model_len,
                                attention_factor(config.rope))
        self.rope = RopeTable(math.upload_float32(cos), math.upload_float32(sin))
        self.scale = softmax_scale(config)

    @staticmethod
    def extra_weight_bytes(config: MlaConfig) -> int:
        """A tied MiniCPM3 scales its embedding apart from its LM head: the table uploaded twice. And the tensors
        uploaded in float32, two bytes an element beyond the bf16 the checkpoint's count assumes: the router's
        correction bias, the indexers' head weights, the sinks, the hyper-connections. And the zero rows that pad
        the parts of each layer's fused linears."""
        c = config
        twice = c.tie_word_embeddings and c.embedding_scale != 1.0
        table = 2 * c.vocab_size * c.hidden_size + 256 if twice else 0
        float32 = len(c.moe.layers) * c.moe.num_experts if c.moe and c.moe.correction_bias else 0
        if c.indexer:
            float32 += sum(c.indexer.own) * c.indexer.num_heads * c.hidden_size
        if c.attention_sinks:
            float32 += c.num_layers * c.num_heads
        if c.hyper:
            float32 += hyper.float32_numel(c.hyper, c.hidden_size, c.num_layers)
        return table + 2 * float32 + 2 * c.hidden_size * sum(padding_rows(rows) for rows in fused_input_rows(c))

    def cache_specs(self) -> tuple[PagedLatent | PagedIndexKeys, ...]:
        """Each layer's latent and rotary key, one vector a token; then, with sparse attention, the index key of
        each layer that runs its own indexer."""
        c = self.config
        index = (PagedIndexKeys(c.indexer.head_dim),) * len(c.indexer.layers) if c.indexer else ()
        return (PagedLatent(c.cache_width),) * c.num_layers + index

    def layer_caches(self, caches: list) -> list[tuple]:
        """(latent cache, index key cache or None) of each layer, from cache_specs' order."""
        c = self.config
        index = dict(zip(c.indexer.layers, caches[c.num_layers:])) if c.indexer else {}
        return [(caches[i], index.get(i)) for i in range(c.num_layers)]

    def replayable(self, batch: ForwardBatch) -> bool:
        """The forward reads every batch only through prepare()."""
        return True

    def forward(self, batch: ForwardBatch, caches: list) -> torch.Tensor:
        """Runs every token of the batch; returns logits [N, vocab] of batch.sample_rows."""
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)
        x = ops.embedding(w["embed"], meta.token_ids)
        residual = selection = None
        for layer, cache in zip(w["layers"], self.layer_caches(caches)):
            h, residual = ops.rms_norm(x, layer["input_layernorm"], c.rms_norm_eps, residual)
            h, selection = self._attention(h, layer, meta, cache, selection)
            h, residual = ops.rms_norm(h, layer["post_attention_layernorm"], c.rms_norm_eps, residual)
            x = self._mlp(h, layer)
        x, residual = ops.sampled_rows(x, residual, meta)
        x, _ = ops.rms_norm(x, w["norm"], c.rms_norm_eps, residual)
        return ops.logits(x, w["lm_head"])

    def _attention(self, h, layer: dict, meta, caches: tuple, selection):
        """The layer's attention output and its sparse attention's choice of tokens (the one it was handed, where
        the layer runs no indexer of its own; None without sparse attention)."""
        ops, c = self.math, self.config
        cache, index_cache = caches
        inputs = layer["attn_in"](ops, h)
        q, compressed = inputs["q"], inputs["latent"]       # compressed: [T, kv_lora_rank + rope_dim]
        if c.q_lora_rank:
            queries = layer["q_up"](ops, ops.rms_norm(q, layer["q_a_layernorm"], c.latent_norm_eps)[0])
            q = queries["q"]
        latent, _ = ops.rms_norm(compressed[:, :c.kv_lora_rank], layer["kv_a_layernorm"], c.latent_norm_eps)
        if index_cache is not None:
            selection = sparse_index.select(ops, layer, c.indexer, h, queries["index_q"], inputs["index_k"], self.rope,
                                            meta, index_cache)
        o = ops.latent_attention(q, latent, compressed[:, c.kv_lora_rank:], layer["mla"], self.rope, meta, cache,
                                 self.scale, selection, layer.get("sinks"))
        if c.gated_attention:
            o = ops.mul_sigmoid(o, inputs["gate"])
        return ops.all_reduce(ops.linear(o, layer["o_proj"], layer.get("o_bias"))), selection

    def _mlp(self, h, layer: dict):
        """The dense MLP, or the mixture of experts with its shared experts' MLP."""
        ops = self.math
        if "router" not in layer:
            return ops.all_reduce(ops.linear(ops.silu_mul(Linear(h, layer["gate_up_proj"])), layer["down_proj"]))
        shared = None
        if "shared" in layer:
            shared = ops.linear(ops.silu_mul(Linear(h, layer["shared"]["up_proj"])), layer["shared"]["down_proj"])
        return ops.all_reduce(ops.moe(h, layer["router"], layer["experts"], shared))


def fused_input_rows(c: MlaConfig) -> list[int]:
    """The rows of every part of every layer's fused linears (attn_in, q_up), as _load_weights stacks them."""
    heads, qk = c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    rows = []
    for i in range(c.num_layers):
        rows += [c.q_lora_rank or heads * qk, c.kv_lora_rank + c.qk_rope_head_dim]
        if c.gated_attention:
            rows.append(heads * c.v_head_dim)
        if c.indexer and c.indexer.own[i]:
            rows.append(c.indexer.head_dim)
        if c.q_lora_rank:                               # q_up's
            rows.append(heads * qk)
            if c.indexer and c.indexer.own[i]:
                rows.append(c.indexer.num_heads * c.indexer.head_dim)
    return rows


def softmax_scale(c: MlaConfig) -> float:
    """1 / sqrt(the query-key head width), times YaRN's mscale(mscale_all_dim) squared where the rope is scaled."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if c.rope["rope_type"] != "default" and c.rope.get("mscale_all_dim"):
        factor = c.rope.get("factor") or c.max_position_embeddings / c.rope["original_max_position_embeddings"]
        scale *= yarn_mscale(factor, c.rope["mscale_all_dim"]) ** 2
    return scale


def _load_weights(c: MlaConfig, tensors: dict[str, torch.Tensor], ops: LayerMath) -> dict:
    take = tensor_reader(tensors, c.architecture, as_float=c.residual_scale != 1.0 or c.embedding_scale != 1.0)
    heads, nope, rope_dim = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    order = rotate_half_order(rope_dim) if c.rope_interleave else torch.arange(rope_dim)
    # A head's query rows: its nope_dim rows as they are, then its rotary rows reordered.
    q_rows = torch.cat([h * (nope + rope_dim) + torch.cat([torch.arange(nope), nope + order]) for h in range(heads)])
    kv_a_rows = torch.cat([torch.arange(c.kv_lora_rank), c.kv_lora_rank + order])

    layers = []
    for i in range(c.num_layers):
        at = f"model.layers.{i}."
        attn = at + "self_attn."
        layer = {"input_layernorm": ops.upload(take(at + "input_layernorm.weight")),
                 "post_attention_layernorm": ops.upload(take(at + "post_attention_layernorm.weight")),
                 "kv_a_layernorm": ops.upload(take(attn + "kv_a_layernorm.weight")),
                 "o_proj": ops.upload(take(attn + "o_proj.weight") * c.residual_scale)}
        # The linears of the layer's normed input, one GEMM (fused_input_rows): the query's (low-rank, or whole),
        # the latent's, Hy4's gate, the indexer's key.
        inputs = {"q": take(attn + "q_a_proj.weight") if c.q_lora_rank else take(attn + "q_proj.weight")[q_rows],
                  "latent": take(attn + "kv_a_proj_with_mqa.weight")[kv_a_rows]}
        if c.gated_attention:
            inputs["gate"] = take(attn + "gate_proj.weight")
        if c.indexer and c.indexer.own[i]:
            inputs["index_k"] = take(at + "self_attn.indexer.wk.weight")[sparse_index.key_rows(c.indexer, rope_dim)]
        biases = None
        if c.attention_bias:
            biases = {"latent": take(attn + "kv_a_proj_with_mqa.bias")[kv_a_rows]}
            if c.q_lora_rank:
                biases["q"] = take(attn + "q_a_proj.bias")
            layer["o_bias"] = ops.upload(take(attn + "o_proj.bias") * c.residual_scale)
        layer["attn_in"] = fuse(ops, inputs, biases)
        if c.q_lora_rank:      # the linears of the normed low-rank query: the query's, the indexer's query
            queries = {"q": take(attn + "q_b_proj.weight")[q_rows]}
            if c.indexer and c.indexer.own[i]:
                queries["index_q"] = take(at + "self_attn.indexer.wq_b.weight")[
                    sparse_index.query_rows(c.indexer, rope_dim)]
            layer.update(q_a_layernorm=ops.upload(take(attn + "q_a_layernorm.weight")), q_up=fuse(ops, queries))
        kv_b = take(attn + "kv_b_proj.weight").view(heads, nope + c.v_head_dim, c.kv_lora_rank)
        layer["mla"] = LatentAttention(ops.upload(kv_b[:, :nope].contiguous()), ops.upload(kv_b[:, nope:].contiguous()),
                                       rope_dim)
        if c.indexer and c.indexer.own[i]:
            layer.update(sparse_index.load_indexer(take, at, c.indexer, rope_dim, ops))
        if c.attention_sinks:
            layer["sinks"] = ops.upload_float32(take(attn + "sinks"))
        if c.moe and i in c.moe.layers:
            layer.update(load_moe(take, tensors.__contains__, at, c.moe, ops))
        else:
            layer["gate_up_proj"] = ops.upload(torch.cat([take(at + "mlp.gate_proj.weight"),
                                                          take(at + "mlp.up_proj.weight")]))
            layer["down_proj"] = ops.upload(take(at + "mlp.down_proj.weight") * c.residual_scale)
        layers.append(layer)
    # MiniCPM3: the embedding times scale_emb (a tied head then its own table), logits = head @ (h / logits_divisor)
    # with the divisor in the final norm's weight.
    table = take("model.embed_tokens.weight")
    if c.tie_word_embeddings and c.embedding_scale == 1.0:
        embed, lm_head = ops.upload_tied(table)
    else:
        embed = ops.upload(table * c.embedding_scale)
        lm_head = ops.upload_lm_head(table if c.tie_word_embeddings else take("lm_head.weight"))
    norm = take("model.norm.weight") / c.logits_divisor
    return {"embed": embed, "lm_head": lm_head, "norm": ops.upload(norm), "layers": layers}
