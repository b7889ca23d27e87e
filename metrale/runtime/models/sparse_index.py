"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, Hy4) as multi-head latent attention models use it: which layers
run an indexer of their own (the others reuse the choice of the last that did), its tensors, and the choice of
tokens it makes for a layer's attention."""

from dataclasses import dataclass

import torch

from metrale.runtime.backend.layer_math import LayerMath, RopeTable, SparseIndexer
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models.rope import rotate_half_order


@dataclass(frozen=True)
class IndexerConfig:
    num_heads: int
    head_dim: int
    topk: int
    norm_eps: float                     # its key's LayerNorm
    rope_first: bool                    # the rotary dims first in each head (DeepSeek-V3.2) or last (Hy4)
    rope_interleave: bool               # the rotary dims in interleaved pairs (Hy4), or rotate-half (DeepSeek-V3.2)
    own: tuple[bool, ...]               # layer i runs its own indexer (else it reuses the last one's choice)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers with an indexer (and an index key cache) of their own."""
        return tuple(i for i, own in enumerate(self.own) if own)


def indexer_config(hf: dict, rope_first: bool, rope_interleave: bool, norm_eps: float) -> IndexerConfig:
    """From config.json's index_* fields and indexer_types ("full" or "shared" per layer; absent: all full)."""
    layers = hf["num_hidden_layers"]
    kinds = hf.get("indexer_types") or ["full"] * layers
    if len(kinds) != layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise InvalidArgument(f"indexer_types {kinds} must give 'full' or 'shared' for each of the {layers} layers, "
                              f"the first 'full'")
    config = IndexerConfig(num_heads=hf["index_n_heads"], head_dim=hf["index_head_dim"], topk=hf["index_topk"],
                           norm_eps=norm_eps, rope_first=rope_first, rope_interleave=rope_interleave,
                           own=tuple(kind == "full" for kind in kinds))
    if config.topk < 1 or config.head_dim < hf["qk_rope_head_dim"]:
        raise InvalidArgument(f"index_topk {config.topk} must be positive and index_head_dim {config.head_dim} hold "
                              f"the rotary {hf['qk_rope_head_dim']} dims")
    return config


def key_rows(config: IndexerConfig, rope_dim: int) -> torch.Tensor:
    """The order a head's dims are read in (the key's wk rows and LayerNorm entries, each query head's wq_b rows):
    interleaved rotary pairs reordered into the rotate-half layout the backends rotate, the rest as they are. The
    LayerNorm's statistics, and every query-key product, do not depend on the order."""
    rope = rotate_half_order(rope_dim) if config.rope_interleave else torch.arange(rope_dim)
    other = torch.arange(config.head_dim - rope_dim)
    return torch.cat([rope, rope_dim + other]) if config.rope_first else torch.cat([other, other.numel() + rope])


def query_rows(config: IndexerConfig, rope_dim: int) -> torch.Tensor:
    """key_rows for each of the index query's heads, in wq_b's rows."""
    rows = key_rows(config, rope_dim)
    return torch.cat([head * config.head_dim + rows for head in range(config.num_heads)])


def load_indexer(take, prefix: str, config: IndexerConfig, rope_dim: int, ops: LayerMath) -> dict:
    """Layer `prefix`'s indexer (its self_attn.indexer tensors), uploaded; its query's and key's projections (wq_b,
    wk) are the model's to fuse with the other linears of their inputs, their rows in key_rows' order."""
    at = prefix + "self_attn.indexer."
    rows = key_rows(config, rope_dim)
    return {"index_norm": ops.upload(take(at + "k_norm.weight")[rows]),
            "index_norm_bias": ops.upload(take(at + "k_norm.bias")[rows]),
            "indexer": SparseIndexer(ops.upload_float32(take(at + "weights_proj.weight")), config.num_heads,
                                     config.head_dim, rope_dim, config.rope_first, config.topk)}


def select(ops: LayerMath, layer: dict, config: IndexerConfig, x, q, k_projected, rope: RopeTable, meta, cache):
    """The layer's choice of tokens for each query: its index query q (wq_b of the attention's normed low-rank
    query), its key from k_projected (wk of x, the layer's normed input), x for the heads' weights."""
    k, _ = ops.layer_norm(k_projected, layer["index_norm"], layer["index_norm_bias"], config.norm_eps)
    return ops.sparse_select(q, k, x, layer["indexer"], rope, meta, cache)

