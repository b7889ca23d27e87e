"""Tencent's Hy4 (HYV4ForCausalLM), in layer math: DeepSeek's multi-head latent attention (rotate-half rotary dims)
with sparse attention (an indexer every few layers, whose choice the layers between reuse), a learned sink logit and
a sigmoid gate per head; DeepSeek-V3's mixture of experts with a clamped SwiGLU in its routed experts; and a residual
of hc_mult hyper-connection streams, collapsed into each block's input and written back after it, then collapsed by
a head before the final norm. The released checkpoint's tensor names are mapped to transformers' (RENAMES)."""

import torch

from metrale.runtime.backend.layer_math import LayerMath
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import deepseek, hyper, sparse_index
from metrale.runtime.models.checkpoint import Renamed, eos_token_ids, tensor_reader
from metrale.runtime.models.hyper import HyperConfig
from metrale.runtime.models.moe import MoeConfig
from metrale.runtime.models.rope import rope_parameters

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
    if hf.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    if not hf.get("q_lora_rank"):
        raise InvalidArgument("Hy4's indexer reads the query's low-rank projection: q_lora_rank must be set")
    heads, eps = hf["num_attention_heads"], hf.get("rms_norm_eps", 1e-5)
    width = hf["moe_intermediate_size"]
    moe = MoeConfig(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], width=width,
                    layers=deepseek.moe_layers({**hf, "first_k_dense_replace": hf.get("first_k_dense_replace", 1)}),
                    scoring="sigmoid", normalize=hf.get("norm_topk_prob", True), correction_bias=True,
                    n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                    scaling=hf.get("routed_scaling_factor", 1.0), shared_width=width * (hf.get("n_shared_experts") or 0),
                    limit=max(hf.get("swiglu_limit", 10.0), 0.0))
    indexer_types = hf.get("indexer_types") or default_indexer_types(hf["num_hidden_layers"])
    hc = HyperConfig(hc_mult=hf.get("hc_mult", 4), norm_eps=eps, eps=hf.get("hc_eps", 1e-6),
                     post_magnitude=hf.get("hc_magnitude", 2.0), post_eps=hf.get("hc_eps", 1e-6))
    return deepseek.MlaConfig(
        architecture=hf["architectures"][0], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], rms_norm_eps=eps,
        rope=rope_parameters(hf), max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=hf.get("tie_word_embeddings", False), rope_interleave=False,
        attention_bias=hf.get("attention_bias", False), moe=moe,
        indexer=sparse_index.indexer_config({**hf, "indexer_types": indexer_types}, rope_first=False, norm_eps=eps),
        gated_attention=True,
        attention_sinks=True, hyper=hc, hc_mult=hc.hc_mult, eos_token_ids=eos_token_ids(hf),
        bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"))


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
        """Each block's input collapsed from the streams, its output written back into them (one boundary op
        between blocks); the streams collapsed by the head, normed, to logits [N, vocab] of batch.sample_rows."""
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)
        streams = ops.hyper_widen(ops.embedding(w["embed"], meta.token_ids), c.hyper.hc_mult)
        x, mix = ops.hyper_collapse(streams, w["layers"][0]["attn_hc"])
        selection = None
        blocks = list(zip(w["layers"], self.layer_caches(caches)))
        for i, (layer, cache) in enumerate(blocks):
            h, _ = ops.rms_norm(x, layer["input_layernorm"], c.rms_norm_eps)
            out, selection = self._attention(h, layer, meta, cache, selection)
            streams, x, mix = ops.hyper_boundary(out, streams, mix, layer["ffn_hc"])
            h, _ = ops.rms_norm(x, layer["post_attention_layernorm"], c.rms_norm_eps)
            out = self._mlp(h, layer)
            if i + 1 < len(blocks):
                streams, x, mix = ops.hyper_boundary(out, streams, mix, blocks[i + 1][0]["attn_hc"])
        streams = ops.hyper_expand(out, streams, mix)
        streams, _ = ops.sampled_rows(streams, streams, meta)
        x, _ = ops.rms_norm(ops.hyper_head(streams, w["hc_head"]), w["norm"], c.rms_norm_eps)
        return ops.logits(x, w["lm_head"])
