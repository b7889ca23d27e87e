"""What a model's layers keep per token or per sequence between steps: one spec per cache tensor, declared by the
model (model.cache_specs(): a layer's, in layer order, then any a layer keeps beside it, such as a sparse indexer's
keys), from which the cache manager sizes, allocates and hands out the cache."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PagedKv:
    """Attention K and V of every token, in blocks of the shared pool: a layer tensor [2, blocks, block_size,
    num_kv_heads, head_dim] in the backend's dtype."""
    num_kv_heads: int
    head_dim: int

    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class PagedLatent:
    """One vector of `width` values per token (multi-head latent attention's compressed KV and its rotary part),
    in blocks of the shared pool: a layer tensor [blocks, block_size, width] in the backend's dtype."""
    width: int

    def elements_per_token(self) -> int:
        return self.width


@dataclass(frozen=True)
class PagedIndexKeys:
    """A sparse attention indexer's key per token (DeepSeek-V3.2's DSA: one vector of `width` values, which the
    indexer scores its queries against), in blocks of the shared pool beside the latents: a tensor [blocks,
    block_size, width] in the backend's dtype."""
    width: int

    def elements_per_token(self) -> int:
        return self.width


@dataclass(frozen=True)
class RecurrentState:
    """A fixed-size state per sequence (an SSM layer's conv and ssm states): one tensor per shape, [slots, *shape]
    in float32, and a sequence's state is one slot of each. A step writes a sequence's advanced state into a new
    slot and keeps the one before as its snapshot until the step is done, so a failed step is undone by the slot."""
    shapes: tuple[tuple[int, ...], ...]

    def elements_per_slot(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


@dataclass(frozen=True)
class NoCache:
    """Nothing kept between steps (a feed-forward layer, a hyper-connection mix)."""


LayerCache = PagedKv | PagedLatent | PagedIndexKeys | RecurrentState | NoCache
PAGED = (PagedKv, PagedLatent, PagedIndexKeys)
# A recurrent state is kept in float32 whatever the backend's dtype: it accumulates over every token.
STATE_ITEMSIZE = 4


def block_bytes(specs: tuple[LayerCache, ...], block_size: int, itemsize: int) -> int:
    """Bytes one block takes across every paged layer."""
    return block_size * itemsize * sum(spec.elements_per_token() for spec in specs if isinstance(spec, PAGED))


def slot_bytes(specs: tuple[LayerCache, ...]) -> int:
    """Bytes one state slot takes across every recurrent layer."""
    return STATE_ITEMSIZE * sum(spec.elements_per_slot() for spec in specs if isinstance(spec, RecurrentState))
