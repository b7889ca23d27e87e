"""The KV block pool: blocks handed out once, shared by reference, and free again after their last holder; the
prefix cache's pool keeps named blocks after it, until an allocation evicts them."""

import pytest

from metrale.runtime.errors import OutOfKvBlocks
from metrale.runtime.cache.blocks import BlockPool


def test_a_shared_block_is_free_after_its_last_holder():
    blocks = BlockPool(4, 16)
    a, b = blocks.allocate(2)
    blocks.share([a, a])                 # three holders of a, one of b
    assert blocks.is_shared(a) and not blocks.is_shared(b)
    blocks.free([a, b])
    assert blocks.num_free == 3 and blocks.is_shared(a)
    blocks.free([a])
    assert blocks.num_free == 3 and not blocks.is_shared(a)
    blocks.free([a])
    assert blocks.num_free == 4


def test_a_reservation_hands_out_only_its_own_ids():
    engine = BlockPool(10, 16)
    reserved = engine.allocate(3)
    call = BlockPool(3, 16, reserved)
    assert sorted(call.allocate(3)) == sorted(reserved) and engine.num_free == 7
    with pytest.raises(OutOfKvBlocks):
        call.allocate(1)


def test_a_reservation_maps_its_ids_to_indices_and_counts_holders():
    """What a device search takes over: each block id as its index in the reservation's ids, the free ones in
    allocate()'s order, each block's holders (0 where free)."""
    call = BlockPool(5, 16, [40, 7, 99, 3, 12])
    assert call.indices([99, 3, 40]).tolist() == [2, 3, 0] and call.indices([]).tolist() == []
    for stranger in ([5], [1000], [0]):
        with pytest.raises(ValueError):
            call.indices(stranger)
    first, second = call.allocate(2)
    call.share([first, first])
    free, holders = call.holders()
    assert free.tolist() == [4, 3, 2]                    # 12, 3, 99: the next allocate() takes 99 first
    assert call.allocate(1) == [99]
    assert holders.tolist() == [3, 1, 0, 0, 0] and (first, second) == (40, 7)


def test_the_prefix_cache_keeps_freed_named_blocks_and_evicts_leaves_first():
    from metrale.runtime.cache.prefix import CachingBlockPool, block_names, chain_root

    pool = CachingBlockPool(5, 4)
    names = block_names(chain_root("model"), list(range(12)), 4)        # a sequence's three full blocks
    blocks = pool.allocate(3)
    for block, name in zip(blocks, names):
        pool.register(block, name)
    pool.free(blocks)
    assert pool.num_free == 5 and pool.num_cached == 3 and pool.match(names) == blocks
    assert pool.allocate(2) and pool.num_cached == 3              # the free list goes first
    pool.allocate(1)                                               # then the leaf, freed first of the three
    assert pool.match(names) == blocks[:2] and pool.counts.evictions == 1
    with pytest.raises(OutOfKvBlocks):
        pool.allocate(3)
    assert pool.num_cached == 2                                    # a refused allocation evicts nothing
