"""Launchers for cuda_kernels/rope_kv.cu: rotary embedding of q and k fused with the paged KV cache write; the
write alone; copies of block prefixes."""

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require, require_aligned
from metrale.runtime.backend.cuda.tensor import DeviceTensor, Fp8KvTensor

MODULE = "rope_kv"
BLOCK = 128


def rope_and_write_kv(lib, stream, qkv: DeviceTensor, cos: DeviceTensor, sin: DeviceTensor, positions: DeviceTensor,
                      slot_mapping: DeviceTensor, kv_cache: DeviceTensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    """Rotates q and k in place in qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] bf16 at positions [T] int32
    (cos/sin [P, head_dim / 2] fp32, rotate-half layout) and writes rotated k and v into
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] bf16 at slot_mapping [T] int32 (slot < 0: no write),
    or into an Fp8KvTensor's e4m3 values, each over its head's scale.
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
    fp8 = kv_cache_scales(kv_cache, "rope_and_write_kv")
    require(len(kv_cache.shape) == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (num_kv_heads, head_dim),
            f"rope_and_write_kv: kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"not {kv_cache.shape}")
    require(kv_cache.is_contiguous and kv_cache.ptr % 8 == 0, "rope_and_write_kv: kv_cache must be contiguous, "
                                                              "8-byte aligned")
    if num_tokens == 0:
        return
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    items = (num_heads + 2 * num_kv_heads) * (head_dim // 8)   # per token: 4 rotary pairs (8 elements) each
    kernel = lib.get("rope_and_write_kv_fp8" if fp8 is not None else "rope_and_write_kv", MODULE)
    launch_kernel(stream, kernel, (num_tokens, ceil_div(items, BLOCK)), BLOCK, qkv, np.int64(qkv.stride), cos, sin,
                  positions, slot_mapping, kv_cache, np.uint64(0) if fp8 is None else fp8, np.int64(num_slots),
                  num_heads, num_kv_heads, head_dim)


def kv_cache_scales(kv_cache: DeviceTensor, name: str) -> DeviceTensor | None:
    """An FP8 cache layer's scales (checked: [2, kv_heads] float32), None for a bf16 layer; other dtypes refused.
    kv_cache is [2, blocks, block_size, kv_heads, head_dim]."""
    if kv_cache.dtype == "bfloat16":
        return None
    require(kv_cache.dtype == "float8_e4m3" and isinstance(kv_cache, Fp8KvTensor),
            f"{name}: kv_cache must be bfloat16, or an Fp8KvTensor's float8_e4m3, not {kv_cache.dtype}")
    scales = kv_cache.scales
    require(scales is not None and scales.dtype == "float32" and scales.shape == (2, kv_cache.shape[-2])
            and scales.is_contiguous and scales.ptr % 4 == 0,
            f"{name}: an FP8 cache's scales must be [2, {kv_cache.shape[-2]}] float32")
    return scales


def write_kv(lib, stream, k: DeviceTensor, v: DeviceTensor, slot_mapping: DeviceTensor, kv_cache: DeviceTensor) -> None:
    """k, v [T, num_kv_heads * head_dim] bf16 (may be column slices) into
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [T] int32 (slot < 0: no write),
    unrotated. Needs 16-byte aligned rows and a width that is a multiple of 8."""
    require(len(kv_cache.shape) == 5 and kv_cache.shape[0] == 2 and kv_cache.dtype == "bfloat16",
            f"write_kv: kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim] bfloat16, not {kv_cache.shape}")
    require(kv_cache.is_contiguous and kv_cache.ptr % 16 == 0, "write_kv: kv_cache must be contiguous, 16-byte aligned")
    width = kv_cache.shape[3] * kv_cache.shape[4]
    require(width % 8 == 0, f"write_kv: kv_heads * head_dim = {width} must be a multiple of 8")
    for name, rows in (("k", k), ("v", v)):
        require(rows.dtype == "bfloat16" and len(rows.shape) == 2 and rows.shape == (k.shape[0], width),
                f"write_kv: {name} must be [T, {width}] bfloat16, not {rows.shape} {rows.dtype}")
        require_aligned(rows, 16, f"write_kv: {name}")
    require(slot_mapping.dtype == "int32" and slot_mapping.shape == (k.shape[0],),
            f"write_kv: slot_mapping must be [{k.shape[0]}] int32")
    if k.shape[0] == 0:
        return
    units = 2 * width // 8
    kernel = lib.get("write_kv", MODULE)
    launch_kernel(stream, kernel, (k.shape[0], ceil_div(units, BLOCK)), BLOCK, k, np.int64(k.stride), v,
                  np.int64(v.stride), slot_mapping, kv_cache, np.int64(kv_cache.shape[1] * kv_cache.shape[2]), width)


def copy_kv_prefixes(lib, stream, kv_cache: list[DeviceTensor], copies: DeviceTensor, num_copies: int) -> None:
    """For each (src block, dst block, n) row of copies [>= num_copies, 3] int32 and every layer of kv_cache (each
    [2, num_blocks, block_size, kv_heads, head_dim] bf16 or e4m3, or a latent cache's [num_blocks, block_size,
    width] bf16, at equal strides from the first): the first n slots of src's K and V (its latent rows) into dst.
    Not checked on the device: block ids in range, n <= block_size."""
    require(bool(kv_cache), "copy_kv_prefixes: no layers")
    first = kv_cache[0]
    require(all(layer.shape == first.shape and layer.dtype == first.dtype and layer.is_contiguous
                for layer in kv_cache) and first.dtype in ("bfloat16", "float8_e4m3"),
            "copy_kv_prefixes: every layer must be one contiguous bfloat16 or float8_e4m3 shape")
    stride = kv_cache[1].ptr - first.ptr if len(kv_cache) > 1 else 0
    require(all(layer.ptr == first.ptr + stride * i for i, layer in enumerate(kv_cache)),
            "copy_kv_prefixes: layers must lie at equal strides")
    require(copies.dtype == "int32" and len(copies.shape) == 2 and copies.shape[1] == 3
            and copies.shape[0] >= num_copies, "copy_kv_prefixes: copies must be [>= num_copies, 3] int32")
    require(len(first.shape) in (3, 5), "copy_kv_prefixes: layers must be K/V [2, blocks, block_size, heads, "
                                        "head_dim] or latent [blocks, block_size, width]")
    planes = 2 if len(first.shape) == 5 else 1
    slot_bytes = (first.shape[3] * first.shape[4] if planes == 2 else first.shape[2]) * first.itemsize
    require(slot_bytes % 16 == 0 and first.ptr % 16 == 0, "copy_kv_prefixes: slots must be 16-byte units")
    if num_copies == 0:
        return
    kernel = lib.get("copy_kv_prefixes", MODULE)
    launch_kernel(stream, kernel, (num_copies, len(kv_cache), planes), BLOCK, first, np.int64(stride),
                  np.int64(first.nbytes // planes), first.shape[-3 if planes == 2 else 1], slot_bytes, copies)


def copy_prefixes(lib, stream, layers: list[DeviceTensor], copies: DeviceTensor, num_copies: int) -> None:
    """copy_kv_prefixes over paged layers of several shapes (a sparse attention model's latents, then its index
    keys): one launch for each run of same-shaped layers at equal strides."""
    groups: list[list[DeviceTensor]] = []
    for layer in layers:
        group = groups[-1] if groups else None
        if (group and (layer.shape, layer.dtype) == (group[0].shape, group[0].dtype)
                and (len(group) == 1 or layer.ptr - group[-1].ptr == group[1].ptr - group[0].ptr)):
            group.append(layer)
        else:
            groups.append([layer])
    for group in groups:
        copy_kv_prefixes(lib, stream, group, copies, num_copies)
