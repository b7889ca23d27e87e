"""M2M100 (NLLB-200's dense checkpoints) as an encoder-decoder, in layer math.

Both stacks are pre-norm Transformer layers with LayerNorm and biased projections, a ReLU feed-forward, and a
final LayerNorm. Token embeddings are shared and scaled by sqrt(d_model) (scale_embedding); positions are
fairseq's sinusoidal table, offset by the padding id, added to the embeddings. The decoder attends causally to
its own paged KV (written by the rope-and-write-KV op with an identity rotation: this model has no rotary
positions) and, without a mask, to its source through per-layer cross-attention K/V that `encode` computes once
per source and writes into the source's own blocks of the same paged pool (a sequence's cross table). The LM head is the shared embedding, unscaled.
"""

import math
from dataclasses import dataclass, replace

import torch

from metrale.runtime.backend.layer_math import LayerMath, Linear, RopeTable
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cache.specs import PagedKv
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.checkpoint import eos_token_ids, tensor_reader
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS


@dataclass(frozen=True)
class M2M100Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_encoder_layers: int
    num_layers: int              # decoder layers: the ones with paged KV
    num_encoder_heads: int
    num_heads: int
    head_dim: int                # d_model / heads (a tensor-parallel rank keeps it, with its share of the heads)
    encoder_ffn: int
    intermediate_size: int       # the decoder's feed-forward width
    max_position_embeddings: int
    scale_embedding: bool
    pad_token_id: int
    decoder_start_token_id: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    layer_norm_eps: float = 1e-5
    is_encoder_decoder: bool = True
    # What Info reports of the architecture: hyper-connection streams (mHC; 0 = none), multi-head latent attention,
    # SSM layers. This family has none of them.
    hc_mult: int = 0
    is_mla: bool = False
    has_ssm: bool = False

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def attention_width(self) -> int:
        """Each of q, k and v's width: hidden_size, or a tensor-parallel rank's share of it."""
        return self.num_heads * self.head_dim


def config_from_hf(hf: dict) -> M2M100Config:
    if hf.get("activation_function", "relu") != "relu":
        raise InvalidArgument(f"activation_function {hf['activation_function']!r} is not supported (relu is)")
    if hf["encoder_attention_heads"] != hf["decoder_attention_heads"]:
        # The encoder keeps its K/V in the decoder's cache blocks as scratch (encode), in the decoder's layout.
        raise InvalidArgument(f"encoder_attention_heads={hf['encoder_attention_heads']} differs from "
                              f"decoder_attention_heads={hf['decoder_attention_heads']}: not supported")
    eos = eos_token_ids(hf)
    return M2M100Config(
        architecture=hf["architectures"][0], vocab_size=hf["vocab_size"], hidden_size=hf["d_model"],
        num_encoder_layers=hf["encoder_layers"], num_layers=hf["decoder_layers"],
        num_encoder_heads=hf["encoder_attention_heads"], num_heads=hf["decoder_attention_heads"],
        head_dim=hf["d_model"] // hf["decoder_attention_heads"], encoder_ffn=hf["encoder_ffn_dim"], intermediate_size=hf["decoder_ffn_dim"],
        max_position_embeddings=hf["max_position_embeddings"], scale_embedding=hf.get("scale_embedding", False),
        pad_token_id=hf["pad_token_id"], decoder_start_token_id=hf["decoder_start_token_id"], eos_token_ids=eos,
        bos_token_id=hf.get("bos_token_id"))


# Tensor parallel (parallel/sharding.py), as the Llama family splits: every attention's q, k and v projections (self
# and cross, encoder and decoder) and fc1 by output rows, their out_proj and fc2 by input columns (biases: rank 0's).
SPLITS = {**{f"{p}_proj.{t}": COLUMNS for p in "qkv" for t in ("weight", "bias")}, "fc1.weight": COLUMNS,
          "fc1.bias": COLUMNS, "out_proj.weight": ROWS, "out_proj.bias": ROWS, "fc2.weight": ROWS, "fc2.bias": ROWS}


def tensor_parallel(config: M2M100Config, shard: Shard) -> tuple[M2M100Config, dict[str, str]]:
    """A rank's config (its share of both stacks' heads and feed-forward widths) and the checkpoint's splits."""
    return replace(config, num_encoder_heads=shard.divided(config.num_encoder_heads, "encoder_attention_heads"),
                   num_heads=shard.divided(config.num_heads, "decoder_attention_heads"),
                   encoder_ffn=shard.divided(config.encoder_ffn, "encoder_ffn_dim"),
                   intermediate_size=shard.divided(config.intermediate_size, "decoder_ffn_dim")), SPLITS


def sinusoidal_positions(num_positions: int, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's table as transformers builds it: [sin | cos] halves, the padding row zero."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(num_positions, dtype=torch.int64).float().unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(num_positions, -1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[padding_idx, :] = 0
    return table


def position_ids(tokens: torch.Tensor, start: int, padding_idx: int) -> torch.Tensor:
    """transformers' positions for a run of tokens after `start` cached ones: padding tokens get the padding row,
    the others count on from start past it."""
    mask = tokens.ne(padding_idx).int()
    return ((torch.cumsum(mask, dim=0).type_as(mask) + start) * mask).long() + padding_idx


class M2M100ForConditionalGeneration:
    def __init__(self, config: M2M100Config, tensors: dict[str, torch.Tensor], ops: LayerMath, max_model_len: int):
        self.config, self.math = config, ops
        # transformers counts a sequence's positions past this id only: a forward over several tokens holding it
        # is not a run of one-token forwards (BeamModel.position_padding_id).
        self.position_padding_id = config.pad_token_id
        c = config
        self.weights = _load_weights(c, tensors, ops)
        positions = sinusoidal_positions(c.max_position_embeddings + 2, c.hidden_size, c.pad_token_id)
        self.positions = ops.upload(positions)
        # An identity rotation: the paged-KV write of the rope op, with no rotary positions (a backend's fused
        # decode attention skips it).
        half = c.head_dim // 2
        self.no_rope = RopeTable(ops.upload_float32(torch.ones(max_model_len, half)),
                                 ops.upload_float32(torch.zeros(max_model_len, half)), identity=True)

    @staticmethod
    def extra_weight_bytes(c: M2M100Config) -> int:
        """Beside the checkpoint's tensors: the shared embedding a second time (scaled for the input, unscaled as
        the LM head) and the sinusoidal position table, in bf16, 256-byte aligned."""
        return 2 * c.vocab_size * c.hidden_size + 2 * (c.max_position_embeddings + 2) * c.hidden_size + 512

    def cache_specs(self) -> tuple[PagedKv, ...]:
        """Each decoder layer's self-attention K/V; a source's cross-attention K/V take blocks of the same layers
        (a sequence's cross table)."""
        return (PagedKv(self.config.num_kv_heads, self.config.head_dim),) * self.config.num_layers

    def replayable(self, batch: ForwardBatch) -> bool:
        """Batches of one-token segments (decode steps) and batches without a padding id take their positions from
        the device metadata; transformers' positions past a padding id in a longer segment are counted on the host,
        from the batch itself."""
        return (all(n == 1 for n in batch.query_lens)
                or not bool((batch.token_ids == self.config.pad_token_id).any()))

    def encode(self, batch: ForwardBatch, kv_cache: list) -> None:
        """The encoder over every source of the batch (one segment each, from position 0, over the source's cross
        blocks); each decoder layer's cross-attention K/V of its states go into those blocks, where the decoder's
        cross-attention reads them. Until then the blocks serve the encoder: layer i keeps its self-attention K/V
        in them (in decoder layer i's cache, modulo the decoder's depth) and attends over them without the
        causal limit, so the encoder needs no attention op of its own and no memory beyond the blocks."""
        self._encode(batch, kv_cache, host_positions=not self.replayable(batch))

    def _encode(self, batch: ForwardBatch, kv_cache: list, host_positions: bool) -> None:
        ops, c, w = self.math, self.config, self.weights
        meta = ops.prepare(batch)
        positions = (ops.device_ids(self._positions(batch)) if host_positions
                     else ops.fairseq_position_ids(meta, c.pad_token_id))
        width, head_dim = c.attention_width, c.head_dim
        for i, layer in enumerate(w["encoder"]):
            if i == 0:      # the token and position embeddings, gathered by the norm
                h, residual = ops.embedding_layer_norm(w["embed"], meta.token_ids, self.positions, positions,
                                                       *layer["self_attn_layer_norm"], c.layer_norm_eps)
            else:
                h, residual = ops.layer_norm(x, *layer["self_attn_layer_norm"], c.layer_norm_eps, residual)
            q, k, v = _split(ops.linear(h, *layer["qkv"]), width)
            scratch = kv_cache[i % len(kv_cache)]
            ops.write_kv(k, v, meta, scratch)
            o = ops.paged_attention(q, scratch, meta, c.num_encoder_heads, head_dim, head_dim ** -0.5, None,
                                    causal=False)
            h = ops.all_reduce(ops.linear(o, *layer["out"]))
            h, residual = ops.layer_norm(h, *layer["final_layer_norm"], c.layer_norm_eps, residual)
            x = ops.all_reduce(ops.linear(ops.linear_relu(h, *layer["fc1"]), *layer["fc2"]))
        states, _ = ops.layer_norm(x, *w["encoder_norm"], c.layer_norm_eps, residual)
        for layer, kv in zip(w["decoder"], kv_cache):
            k, v = _split(ops.linear(states, *layer["cross_kv"]), width, parts=2)
            ops.write_kv(k, v, meta, kv)

    def forward(self, batch: ForwardBatch, kv_cache: list) -> torch.Tensor:
        """The decoder over every token of the batch; logits [N, vocab] of batch.sample_rows. batch.cross holds
        the same rows over their sources' cross-attention blocks, written by encode()."""
        if batch.cross is None:
            raise InvalidArgument("an encoder-decoder forward needs its sources' cross-attention blocks")
        return self._decode(batch, kv_cache, host_positions=not self.replayable(batch))

    def _decode(self, batch: ForwardBatch, kv_cache: list, host_positions: bool) -> torch.Tensor:
        ops, c, w = self.math, self.config, self.weights
        meta, cross = ops.prepare(batch), ops.prepare(batch.cross, cross=True)
        positions = (ops.device_ids(self._positions(batch)) if host_positions
                     else ops.fairseq_position_ids(meta, c.pad_token_id))
        scale, eps, width = c.head_dim ** -0.5, c.layer_norm_eps, c.attention_width
        for i, (layer, kv) in enumerate(zip(w["decoder"], kv_cache)):
            if i == 0:      # the token and position embeddings, gathered by the norm
                h, residual = ops.embedding_layer_norm(w["embed"], meta.token_ids, self.positions, positions,
                                                       *layer["self_attn_layer_norm"], eps)
            else:
                h, residual = ops.layer_norm(x, *layer["self_attn_layer_norm"], eps, residual)
            q, k, v = _split(ops.linear(h, *layer["qkv"]), width)
            o = ops.self_attention(q, k, v, self.no_rope, meta, kv, c.num_heads, c.head_dim, scale, None)
            h, residual = ops.layer_norm(ops.all_reduce(Linear(o, *layer["out"])), *layer["encoder_attn_layer_norm"],
                                         eps, residual)
            o = ops.paged_attention(Linear(h, *layer["cross_q"]), kv, cross, c.num_heads, c.head_dim, scale, None,
                                    causal=False)
            h, residual = ops.layer_norm(ops.all_reduce(Linear(o, *layer["cross_out"])), *layer["final_layer_norm"],
                                         eps, residual)
            x = ops.all_reduce(Linear(ops.linear_relu(h, *layer["fc1"]), *layer["fc2"]))
        x, residual = ops.sampled_rows(x, residual, meta)
        x, _ = ops.layer_norm(x, *w["decoder_norm"], eps, residual)
        return ops.logits(x, w["lm_head"])

    def _positions(self, batch: ForwardBatch) -> torch.Tensor:
        """Rows of the sinusoidal table for the batch's tokens (transformers' padding-aware position ids)."""
        pad = self.config.pad_token_id
        if bool((batch.token_ids == pad).any()):
            return torch.cat([position_ids(batch.token_ids[s:s + n], context - n, pad)
                              for s, n, context in zip(batch.query_starts, batch.query_lens, batch.context_lens)])
        return batch.positions + 1 + pad     # no padding token among them: each counts on from its position


def _split(x, width: int, parts: int = 3):
    return tuple(x[:, i * width:(i + 1) * width] for i in range(parts))


def _load_weights(c: M2M100Config, tensors: dict[str, torch.Tensor], ops: LayerMath) -> dict:
    take = tensor_reader(tensors, c.architecture)

    def pair(prefix: str) -> tuple:
        return ops.upload(take(prefix + ".weight")), ops.upload(take(prefix + ".bias"))

    def packed(prefix: str, names: tuple[str, ...]) -> tuple:
        return (ops.upload(torch.cat([take(f"{prefix}.{n}.weight") for n in names])),
                ops.upload(torch.cat([take(f"{prefix}.{n}.bias") for n in names])))

    shared = take("model.shared.weight")
    scale = math.sqrt(c.hidden_size) if c.scale_embedding else 1.0
    weights = {"embed": ops.upload(shared * scale), "lm_head": ops.upload_lm_head(shared),
               "encoder_norm": pair("model.encoder.layer_norm"), "decoder_norm": pair("model.decoder.layer_norm"),
               "encoder": [], "decoder": []}
    qkv = ("q_proj", "k_proj", "v_proj")
    for i in range(c.num_encoder_layers):
        p = f"model.encoder.layers.{i}"
        weights["encoder"].append({
            "self_attn_layer_norm": pair(f"{p}.self_attn_layer_norm"), "qkv": packed(f"{p}.self_attn", qkv),
            "out": pair(f"{p}.self_attn.out_proj"), "final_layer_norm": pair(f"{p}.final_layer_norm"),
            "fc1": pair(f"{p}.fc1"), "fc2": pair(f"{p}.fc2")})
    for i in range(c.num_layers):
        p = f"model.decoder.layers.{i}"
        weights["decoder"].append({
            "self_attn_layer_norm": pair(f"{p}.self_attn_layer_norm"), "qkv": packed(f"{p}.self_attn", qkv),
            "out": pair(f"{p}.self_attn.out_proj"), "encoder_attn_layer_norm": pair(f"{p}.encoder_attn_layer_norm"),
            "cross_q": pair(f"{p}.encoder_attn.q_proj"), "cross_kv": packed(f"{p}.encoder_attn", ("k_proj", "v_proj")),
            "cross_out": pair(f"{p}.encoder_attn.out_proj"), "final_layer_norm": pair(f"{p}.final_layer_norm"),
            "fc1": pair(f"{p}.fc1"), "fc2": pair(f"{p}.fc2")})
    return weights
