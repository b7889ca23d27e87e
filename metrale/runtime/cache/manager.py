"""The cache of every layer, as the model's specs describe it: one block pool for the paged layers (K/V, latent),
one slot pool for the recurrent layers' states, and the layer tensors the runner allocated for them. Reservations
are all or nothing across the two pools."""

from metrale.runtime.cache.blocks import BlockPool, blocks_for
from metrale.runtime.cache.prefix import CachingBlockPool, PrefixCounts
from metrale.runtime.cache.specs import PAGED, LayerCache, RecurrentState, block_bytes, slot_bytes
from metrale.runtime.cache.states import StatePool
from metrale.runtime.errors import OutOfKvBlocks, OutOfStateSlots


class CacheManager:
    """layers[i] is layer i's cache as its spec says (runner.allocate_cache): a paged tensor, a tuple of state
    tensors, or None."""

    def __init__(self, specs: tuple[LayerCache, ...], layers: list, block_size: int, num_blocks: int,
                 num_state_slots: int, prefix_cache: bool = False, max_snapshots: int = 0):
        """prefix_cache: the block pool keeps full blocks for later prompts (cache/prefix.py), and, of a model with
        recurrent layers, up to max_snapshots states at block boundaries (cache/states.py)."""
        self.specs, self.layers, self.block_size = specs, layers, block_size
        self.blocks = CachingBlockPool(num_blocks, block_size) if prefix_cache else BlockPool(num_blocks, block_size)
        self.states = StatePool(num_state_slots, max_snapshots if prefix_cache else 0)

    @property
    def prefix_cache(self) -> bool:
        """Whether full blocks are kept and reused (cache/prefix.py)."""
        return isinstance(self.blocks, CachingBlockPool)

    @property
    def num_cached(self) -> int:
        """Blocks only the prefix cache holds (counted as free); 0 where it is off."""
        return self.blocks.num_cached if self.prefix_cache else 0

    @property
    def prefix_counts(self) -> PrefixCounts | None:
        """The prefix cache's hits, misses and evictions; None where it is off."""
        return self.blocks.counts if self.prefix_cache else None

    @property
    def has_state(self) -> bool:
        """Whether a sequence holds a state slot (the model has recurrent layers)."""
        return any(isinstance(spec, RecurrentState) for spec in self.specs)

    def reserve(self, num_blocks: int, num_slots: int, evict_snapshots: bool = True) -> tuple[list[int], list[int]]:
        """Blocks and state slots, both or neither: OutOfKvBlocks or OutOfStateSlots with nothing taken.
        evict_snapshots False: slots only from the free ones, no snapshot evicted for them."""
        if num_blocks > self.blocks.num_free:
            raise OutOfKvBlocks(num_blocks, self.blocks.num_free)
        free_slots = self.states.num_free if evict_snapshots else self.states.num_unused
        if num_slots > free_slots:
            raise OutOfStateSlots(num_slots, free_slots)
        return self.blocks.allocate(num_blocks), self.states.allocate(num_slots)

    def free(self, blocks: list[int], slots: list[int] = ()) -> None:
        self.blocks.free(blocks)
        self.states.free(list(slots))


def state_slots_for(specs: tuple[LayerCache, ...], max_seqs: int, max_snapshots: int = 0, runs_ahead: bool = False
                    ) -> int:
    """A recurrent model's state slots: max_seqs live sequences, each with a second slot for a step in flight (and a
    third for a guessed step's successor, where the engine runs ahead), and the prefix cache's snapshots."""
    per_sequence = 3 if runs_ahead else 2
    return per_sequence * max_seqs + max_snapshots if any(isinstance(spec, RecurrentState) for spec in specs) else 0


def snapshots_for(specs: tuple[LayerCache, ...], snapshot_bytes: int | None, max_seqs: int) -> int:
    """How many state snapshots snapshot_bytes hold (None: max_seqs); 0 for a model without recurrent layers."""
    per_slot = slot_bytes(specs)
    if not per_slot:
        return 0
    return max_seqs if snapshot_bytes is None else snapshot_bytes // per_slot


def blocks_that_fit(specs: tuple[LayerCache, ...], block_size: int, itemsize: int, available_bytes: int,
                    num_state_slots: int, max_model_len: int) -> int:
    """The blocks the memory left after the state slots holds (at least 1). A model with no paged layer still
    counts its sequences' tokens in blocks, which then cost nothing: enough for every slot's longest sequence."""
    per_block = block_bytes(specs, block_size, itemsize)
    if not any(isinstance(spec, PAGED) for spec in specs):
        return max(1, num_state_slots * blocks_for(max_model_len, block_size) // 2)
    return max(1, (available_bytes - num_state_slots * slot_bytes(specs)) // per_block)
