"""Tencent's Hy4 (HYV4ForCausalLM), in layer math: DeepSeek's multi-head latent attention (rotary dims in interleaved
pairs, as transformers >= 5.25 rotates them) with sparse attention (an indexer every few layers, whose choice the
layers between reuse), a learned sink logit and a sigmoid gate per head; DeepSeek-V3's mixture of experts with a
clamped SwiGLU in its routed experts; and a residual of hc_mult hyper-connection streams, collapsed into each block's
input and written back after it, then collapsed by a head before the final norm. The released checkpoint's tensor
names are mapped to transformers' (RENAMES)."""

import dataclasses

import torch

from metrale.runtime.backend.layer_math import LayerMath, RmsNorm
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import deepseek, hyper, sparse_index
from metrale.runtime.models.checkpoint import Renamed, tensor_reader
from metrale.runtime.models.hyper import HyperConfig
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS

# Released name -> transformers' (its conversion mapping for hy_v4), applied in order.
RENAMES = [
    (r"\.hc_pre\.hc_", ".hc_"),
    (r"\.learnable_sink_param", ".sinks"),
    (r"\.linear_gate", ".gate_proj"),
    (r"\.hc_attn_layer\.hc_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_mlp_layer\.hc_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.hc_head_(fn|base|scale)$", r".hc_\1"),
]


def config_from_hf(hf: dict) -> deepseek.MlaConfig:
    """DeepSeek-V3's config read from Hy4's (its latent attention, its sigmoid router; the first layer dense where
    config.json does not say), then what Hy4 adds: interleaved rotary dims in its indexers too, the indexers, sinks
    and gates, the experts' clamp and the hyper-connections."""
    if not hf.get("q_lora_rank"):
        raise InvalidArgument("Hy4's indexer reads the query's low-rank projection: q_lora_rank must be set")
    hf = {"rms_norm_eps": 1e-5, "first_k_dense_replace": 1, **hf}         # HYV4Config's defaults
    v3 = deepseek.config_from_hf({**hf, "architectures": ["DeepseekV3ForCausalLM"]})
    eps = v3.rms_norm_eps
    indexer_types = hf.get("indexer_types") or default_indexer_types(hf["num_hidden_layers"])
    hc = HyperConfig(hc_mult=hf.get("hc_mult", 4), norm_eps=eps, eps=hf.get("hc_eps", 1e-6),
                     post_magnitude=hf.get("hc_magnitude", 2.0), post_eps=hf.get("hc_eps", 1e-6))
    return dataclasses.replace(
        v3, architecture=hf["architectures"][0], rope_interleave=True,
        moe=dataclasses.replace(v3.moe, limit=max(hf.get("swiglu_limit", 10.0), 0.0)),
        indexer=sparse_index.indexer_config({**hf, "indexer_types": indexer_types}, rope_first=False,
                                            rope_interleave=True, norm_eps=eps),
        gated_attention=True, attention_sinks=True, hyper=hc, hc_mult=hc.hc_mult)


def tensor_parallel(config: deepseek.MlaConfig, shard: Shard) -> tuple[deepseek.MlaConfig, dict]:
    """DeepSeek's split (deepseek.tensor_parallel: heads, with their gates and sinks; the latent, the indexers and
    here the hyper-connections whole), under the released checkpoint's names of the gate and sinks too (RENAMES
    maps them after the split reads them)."""
    local, splits = deepseek.tensor_parallel(config, shard)
    return local, {**splits, "linear_gate.weight": COLUMNS, "learnable_sink_param": COLUMNS}


def default_indexer_types(layers: int) -> list[str]:
    """transformers' indexer_types where config.json gives none: an indexer in the first layer and in every fourth
    from the second, the layers between sharing the last one's choice."""
    return ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)]


class HyV4ForCausalLM(deepseek.DeepseekForCausalLM):
    def __init__(self, config: deepseek.MlaConfig, tensors: dict[str, torch.Tensor], math: LayerMath,
                 max_model_len: int):
        tensors = Renamed(tensors, RENAMES)
        super().__init__(config, tensors, math, max_model_len)
        take = tensor_reader(tensors, config.architecture)
        hc, hidden = config.hyper, config.hidden_size
        for i, layer in enumerate(self.weights["layers"]):
            at = f"model.layers.{i}."
            layer["attn_hc"] = hyper.load_connection(take, at + "attn_hc.", hc, hidden, math)
            layer["ffn_hc"] = hyper.load_connection(take, at + "ffn_hc.", hc, hidden, math)
        self.weights["hc_head"] = hyper.load_head(take, "model.hc_head.", hc, math)

    def forward(self, batch: ForwardBatch, caches: list) -> torch.Tensor:
        """Each block's input collapsed from the streams and normed, its output written back into them (one
        boundary op between blocks, the next block's norm in it); the streams collapsed by the head and normed, to
        logits [N, vocab] of batch.sample_rows."""
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)

        def norm(weight):
            return RmsNorm(weight, c.rms_norm_eps)

        streams = ops.hyper_widen(ops.embedding(w["embed"], meta.token_ids), c.hyper.hc_mult)
        first = w["layers"][0]
        h, mix = ops.hyper_collapse(streams, first["attn_hc"], norm(first["input_layernorm"]))
        selection = None
        blocks = list(zip(w["layers"], self.layer_caches(caches)))
        for i, (layer, cache) in enumerate(blocks):
            out, selection = self._attention(h, layer, meta, cache, selection)
            streams, h, mix = ops.hyper_boundary(out, streams, mix, layer["ffn_hc"],
                                                 norm(layer["post_attention_layernorm"]))
            out = self._mlp(h, layer)
            if i + 1 < len(blocks):
                following = blocks[i + 1][0]
                streams, h, mix = ops.hyper_boundary(out, streams, mix, following["attn_hc"],
                                                     norm(following["input_layernorm"]))
        streams = ops.hyper_expand(out, streams, mix)
        streams, _ = ops.sampled_rows(streams, streams, meta)
        return ops.logits(ops.hyper_head(streams, w["hc_head"], norm(w["norm"])), w["lm_head"])
