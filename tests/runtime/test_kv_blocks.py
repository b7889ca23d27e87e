"""The KV block pool: blocks handed out once, shared by reference, and free again after their last holder."""

import pytest

from metrale.runtime.errors import OutOfKvBlocks
from metrale.runtime.kv_blocks import KvBlockManager


def test_a_shared_block_is_free_after_its_last_holder():
    blocks = KvBlockManager(4, 16)
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
    engine = KvBlockManager(10, 16)
    reserved = engine.allocate(3)
    call = KvBlockManager(3, 16, reserved)
    assert sorted(call.allocate(3)) == sorted(reserved) and engine.num_free == 7
    with pytest.raises(OutOfKvBlocks):
        call.allocate(1)
