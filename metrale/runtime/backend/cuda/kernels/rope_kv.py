"""Launcher for cuda_kernels/rope_kv.cu: rotary embedding of q and k fused with the paged KV cache write."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "rope_kv"
BLOCK = 128


def rope_and_write_kv(lib, stream, qkv: DeviceTensor, cos: DeviceTensor, sin: DeviceTensor, positions: DeviceTensor,
                      slot_mapping: DeviceTensor, kv_cache: DeviceTensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    """Rotates q and k in place in qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] bf16 at positions [T] int32
    (cos/sin [P, head_dim / 2] fp32, rotate-half layout) and writes rotated k and v into
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16 at slot_mapping [T] int32 (slot < 0: no write).
    Layout in rope_kv.cu. Needs head_dim % 8 == 0, qkv rows 8-byte aligned, cos/sin 16-byte aligned, 0 <= positions < P,
    slots < num_blocks * block_size."""
    require(num_heads > 0 and num_kv_heads > 0, "rope_and_write_kv: num_heads and num_kv_heads must be positive")
    require(head_dim > 0 and head_dim % 8 == 0, f"rope_and_write_kv: head_dim {head_dim} must be a multiple of 8")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    require(qkv.dtype == "bfloat16" and len(qkv.shape) == 2 and qkv.shape[1] == width,
            f"rope_and_write_kv: qkv must be [T, {width}] bfloat16, not {qkv.shape} {qkv.dtype}")
    require_aligned(qkv, 8, "rope_and_write_kv: qkv")
    num_tokens = qkv.shape[0]
    for name, table in (("cos", cos), ("sin", sin)):
        require(table.dtype == "float32" and len(table.shape) == 2 and table.shape[1] == head_dim // 2,
                f"rope_and_write_kv: {name} must be [P, {head_dim // 2}] float32, not {table.shape} {table.dtype}")
        require(table.is_contiguous and table.ptr % 16 == 0, f"rope_and_write_kv: {name} must be contiguous, "
                                                             f"16-byte aligned")
    require(cos.shape == sin.shape, f"rope_and_write_kv: cos {cos.shape} and sin {sin.shape} differ")
    for name, meta in (("positions", positions), ("slot_mapping", slot_mapping)):
        require(meta.dtype == "int32" and meta.shape == (num_tokens,),
                f"rope_and_write_kv: {name} must be [{num_tokens}] int32, not {meta.shape} {meta.dtype}")
        require(meta.ptr % 4 == 0, f"rope_and_write_kv: {name} must be 4-byte aligned")
    require(kv_cache.dtype == "bfloat16" and len(kv_cache.shape) == 5 and kv_cache.shape[0] == 2
            and kv_cache.shape[3:] == (num_kv_heads, head_dim),
            f"rope_and_write_kv: kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}] bfloat16, "
            f"not {kv_cache.shape} {kv_cache.dtype}")
    require(kv_cache.is_contiguous and kv_cache.ptr % 8 == 0, "rope_and_write_kv: kv_cache must be contiguous, "
                                                              "8-byte aligned")
    if num_tokens == 0:
        return
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    items = (num_heads + 2 * num_kv_heads) * (head_dim // 8)   # per token: 4 rotary pairs (8 elements) each
    kernel = lib.get("rope_and_write_kv", MODULE)
    launch_kernel(stream, kernel, (num_tokens, ceil_div(items, BLOCK)), BLOCK, qkv, np.int64(qkv.stride), cos, sin,
                  positions, slot_mapping, kv_cache, np.int64(num_slots), num_heads, num_kv_heads, head_dim)
