"""An FP8 KV cache layer on the CPU (cache/specs.py's PagedKvFp8), and the two ways the CPU layer math reaches any K/V
layer: store a step's K and V at their slots, read the K or V planes of some blocks as float."""

import torch

from metrale.runtime.cache.specs import PagedKvFp8
from metrale.runtime.loading.fp8 import to_e4m3


class Fp8Kv:
    """values float8_e4m3fn [2, blocks, block_size, kv_heads, head_dim]; scales float32 [2, kv_heads, 1] (K's, V's:
    the spec's, shaped to divide a [..., kv_heads, head_dim] tensor)."""

    def __init__(self, spec: PagedKvFp8, num_blocks: int, block_size: int):
        self.values = torch.zeros((2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim),
                                  dtype=torch.float8_e4m3fn)
        self.scales = torch.tensor(spec.scales, dtype=torch.float32).unsqueeze(-1)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def quantized(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, head_dim] over its heads' scales [kv_heads, 1], rounded to nearest e4m3, saturated."""
    return to_e4m3(x.float() / scales)


def store_kv(kv, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V [tokens, kv_heads, head_dim] written at their cache slots (block x block_size + offset)."""
    if isinstance(kv, Fp8Kv):
        flat = kv.values.view(2, -1, *kv.shape[3:])
        flat[0, slots], flat[1, slots] = quantized(k, kv.scales[0]), quantized(v, kv.scales[1])
        return
    flat = kv.view(2, -1, *kv.shape[3:])
    flat[0, slots], flat[1, slots] = k, v


def kv_plane(kv, plane: int, blocks) -> torch.Tensor:
    """K (plane 0) or V (1) of the blocks `blocks` indexes: [..., block_size, kv_heads, head_dim], an FP8 layer's as
    float32 (value x its head's scale)."""
    if isinstance(kv, Fp8Kv):
        return kv.values[plane][blocks].float() * kv.scales[plane]
    return kv[plane][blocks]
