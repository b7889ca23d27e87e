"""TMA tensor maps (CUtensorMap, sm_90 and later) of KV caches: encoded by the driver on the host, then kept in
device memory, where cp.async.bulk.tensor reads them by address (so a kernel takes a map as a plain pointer)."""

import numpy as np
from cuda.bindings import driver

from metrale.runtime.backend.cuda.device import check
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MAP_BYTES = 128
BOX_COLUMNS = 64        # a box row: 64 bf16 columns, the 128 bytes the 128-byte swizzle spans

# (cache pointer, shape) -> the device address of its map; a cache's map lives as long as the process (128 bytes), and
# one freed cache's map serves a later one at the same address and shape.
_maps: dict[tuple[int, tuple[int, ...]], int] = {}


def paged_kv_map(kv_cache: DeviceTensor) -> int:
    """The device address of a map over kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16 seen as
    the 4-D tensor (head_dim, num_kv_heads, num_blocks * block_size, 2), innermost first, in boxes of
    (64, 1, block_size, 1) with the 128-byte swizzle: one page's rows of one KV head's 64 columns of K or V, as the
    Hopper kernels lay tiles out in shared memory. The first call for a cache uploads its map with a synchronous
    copy, so it must not be made inside a stream capture (CudaRunner.allocate_cache makes the maps of its caches)."""
    key = (kv_cache.ptr, kv_cache.shape)
    if key not in _maps:
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        rows = num_blocks * block_size
        row_bytes = num_kv_heads * head_dim * 2
        encoded = check(driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, kv_cache.ptr,
            [driver.cuuint64_t(n) for n in (head_dim, num_kv_heads, rows, 2)],
            [driver.cuuint64_t(n) for n in (head_dim * 2, row_bytes, rows * row_bytes)],
            [driver.cuuint32_t(n) for n in (BOX_COLUMNS, 1, block_size, 1)],
            [driver.cuuint32_t(1)] * 4,
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
        host = np.array([int(word) for word in encoded.opaque], dtype=np.uint64)
        address = int(check(driver.cuMemAlloc(MAP_BYTES)))
        check(driver.cuMemcpyHtoD(address, host.ctypes.data, MAP_BYTES))
        _maps[key] = address
    return _maps[key]
