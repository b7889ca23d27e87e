"""What a model's layers keep per token or per sequence between steps: one spec per cache tensor, declared by the
model (model.cache_specs(): a layer's, in layer order, then any a layer keeps beside it, such as a sparse indexer's
keys), from which the cache manager sizes, allocates and hands out the cache."""

import math
from dataclasses import dataclass

from metrale.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class PagedKv:
    """Attention K and V of every token, in blocks of the shared pool: a layer tensor [2, blocks, block_size,
    num_kv_heads, head_dim] in the backend's dtype."""
    num_kv_heads: int
    head_dim: int
    # K's and V's scale for each KV head where the checkpoint gives them (a kv_cache_scheme's k_scale and v_scale),
    # for an FP8 cache (PagedKvFp8); None: none given.
    scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class PagedKvFp8:
    """PagedKv kept in FP8 (--kv-dtype fp8): [2, blocks, block_size, num_kv_heads, head_dim] of e4m3 values, each K
    or V value over its head's scale, rounded to nearest and saturated at +-448; scales [2, num_kv_heads] float32
    (K's, then V's). Attention reads value x scale, for every cached token, the step's own included."""
    num_kv_heads: int
    head_dim: int
    scales: tuple[tuple[float, ...], tuple[float, ...]]

    def bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim           # a byte a value, whatever the model's dtype


@dataclass(frozen=True)
class PagedLatent:
    """One vector of `width` values per token (multi-head latent attention's compressed KV and its rotary part),
    in blocks of the shared pool: a layer tensor [blocks, block_size, width] in the backend's dtype."""
    width: int

    def bytes_per_token(self, itemsize: int) -> int:
        return itemsize * self.width


@dataclass(frozen=True)
class PagedIndexKeys:
    """A sparse attention indexer's key per token (DeepSeek-V3.2's DSA: one vector of `width` values, which the
    indexer scores its queries against), in blocks of the shared pool beside the latents: a tensor [blocks,
    block_size, width] in the backend's dtype."""
    width: int

    def bytes_per_token(self, itemsize: int) -> int:
        return itemsize * self.width


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


LayerCache = PagedKv | PagedKvFp8 | PagedLatent | PagedIndexKeys | RecurrentState | NoCache
PAGED = (PagedKv, PagedKvFp8, PagedLatent, PagedIndexKeys)
KV_DTYPES = ("auto", "fp8")
# A recurrent state is kept in float32 whatever the backend's dtype: it accumulates over every token.
STATE_ITEMSIZE = 4


def block_bytes(specs: tuple[LayerCache, ...], block_size: int, itemsize: int) -> int:
    """Bytes one block takes across every paged layer (itemsize: the backend's dtype's)."""
    return block_size * sum(spec.bytes_per_token(itemsize) for spec in specs if isinstance(spec, PAGED))


def with_kv_dtype(specs: tuple[LayerCache, ...], kv_dtype: str) -> tuple[LayerCache, ...]:
    """The model's specs with its attention K/V in kv_dtype: "auto" keeps the model's dtype, "fp8" makes each
    PagedKv a PagedKvFp8 with the checkpoint's scales (one for all heads spread to each), or 1 for every head where
    it gives none. InvalidArgument for fp8 where no layer caches K and V, or for scales that do not fit the heads."""
    if kv_dtype not in KV_DTYPES:
        raise InvalidArgument(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "auto":
        return specs
    if not any(isinstance(spec, PagedKv) for spec in specs):
        raise InvalidArgument("--kv-dtype fp8 caches attention K and V in FP8, and this model caches none (its "
                              "latent or state caches stay in the model's dtype)")
    return tuple(PagedKvFp8(spec.num_kv_heads, spec.head_dim, _head_scales(spec, layer))
                 if isinstance(spec, PagedKv) else spec for layer, spec in enumerate(specs))


def _head_scales(spec: PagedKv, layer: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if spec.scales is None:
        return ((1.0,) * spec.num_kv_heads,) * 2
    names = ("k_scale", "v_scale")
    if missing := [name for name, scales in zip(names, spec.scales) if not scales]:
        raise InvalidArgument(f"layer {layer} has a K or V scale but no {missing[0]}")
    heads = []
    for name, scales in zip(names, spec.scales):
        if len(scales) not in (1, spec.num_kv_heads) or not all(0 < s < math.inf for s in scales):
            raise InvalidArgument(f"layer {layer}'s {name} must be one positive scale or one per KV head "
                                  f"({spec.num_kv_heads} here), not {list(scales)}")
        heads.append(tuple(scales) * (spec.num_kv_heads // len(scales)))
    return heads[0], heads[1]


def slot_bytes(specs: tuple[LayerCache, ...]) -> int:
    """Bytes one state slot takes across every recurrent layer."""
    return STATE_ITEMSIZE * sum(spec.elements_per_slot() for spec in specs if isinstance(spec, RecurrentState))
