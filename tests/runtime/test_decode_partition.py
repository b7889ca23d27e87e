"""How decode attention is split across CTAs (kernels/attention.py), without a GPU: every key of the planned
context in one split, the split search against the full search, the workspace bound over every batch and context,
and the splits following the device's waves."""

import pytest

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.kernels import attention  # noqa: E402
from metrale.runtime.backend.cuda.kernels.attention import (CONTEXT_QUANTUM, KV_TILE, decode_partition,  # noqa: E402
                                                            decode_workspace_bound, decode_workspace_elements)
from metrale.runtime.backend.cuda.launch import ceil_div  # noqa: E402


@pytest.mark.parametrize("batch, max_context", [(1, 1), (1, 1024), (1, 8192), (8, 4096), (64, 1024),
                                                (256, 1024), (8, 32768), (3, 100)])
def test_decode_partition_covers_the_context(batch, max_context):
    partition, splits = decode_partition(batch, 8, max_context, 396)
    planned = ceil_div(max_context, CONTEXT_QUANTUM) * CONTEXT_QUANTUM
    assert partition % KV_TILE == 0 and partition >= KV_TILE
    # every key of the planned (rounded-up) context in one split, and no split past it
    assert (splits - 1) * partition < planned <= splits * partition and max_context <= planned


def test_decode_partition_search_matches_the_full_search():
    # The search stops a few waves past one; the full search over every split size must find nothing cheaper
    # while the pairs do not fill the device, and nothing more than 5% cheaper once they do (max_splits).
    overhead, tile = attention.SPLIT_OVERHEAD_TILES, attention.KV_TILE

    def cost(groups, tiles, resident, per_split):
        return ceil_div(groups * ceil_div(tiles, per_split), resident) * (per_split + overhead)
    for resident in (132, 396, 660):
        for groups in (1, 8, 24, 64, 256, 400, 1024, 4096):
            for context in (64, 1024, 1232, 4096, 32768, 131072):
                tiles = ceil_div(context, tile)
                partition, splits = attention._partition(groups, 1, context, resident)
                best = min(cost(groups, tiles, resident, p) for p in range(1, tiles + 1))
                ours = cost(groups, tiles, resident, partition // tile)
                assert ours == best if groups < resident else ours <= 1.05 * best, (resident, groups, context)


class ResidentLibrary:
    def __init__(self, resident):
        self.resident = resident

    def resident_ctas(self, kernel_name, module, threads):
        return self.resident


@pytest.mark.parametrize("resident", [132, 396, 660])
def test_decode_workspace_bound_covers_every_batch_and_context(resident):
    lib = ResidentLibrary(resident)
    for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
        bound = decode_workspace_bound(lib, 64, heads, kv_heads, head_dim, 8192)
        needed = max(decode_workspace_elements(lib, b, heads, kv_heads, head_dim, context)
                     for b in range(1, 65) for context in (1, 100, 1000, 1024, 3000, 8000, 8192))
        assert 0 < needed <= bound


def test_decode_partition_follows_the_waves():
    # batch 1: everything fits one wave, so one tile per split
    assert decode_partition(1, 8, 1024, 396) == (KV_TILE, 1024 // KV_TILE)
    # the sequences alone fill the device several times over: whole contexts, no reduce
    assert decode_partition(256, 8, 1024, 396) == (1024, 1)
    # in between, more splits than one but fewer than one per tile
    partition, splits = decode_partition(64, 8, 4096, 396)
    assert 1 < splits < 4096 // KV_TILE
