"""GGUF block bytes for the tests: any kind quantized from float weights (gguf.quants.quantize where it can, Q4_K,
Q5_K and Q6_K here, since gguf only reads them), and random blocks of any kind."""

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# kind -> bytes at the start of a block that are fp16 fields (d, and m or dmin), kept finite in random blocks.
FP16_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q8_0": 2, "Q4_K": 4, "Q5_K": 4}


def quantize(weight: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, columns] -> the GGUF tensor's bytes, uint8 [rows, bytes a row]."""
    encoders = {"Q4_K": lambda w: _k_blocks(w, 4), "Q5_K": lambda w: _k_blocks(w, 5), "Q6_K": _q6_k_blocks}
    if kind not in encoders:
        return gguf.quants.quantize(weight, GGMLQuantizationType[kind])
    return encoders[kind](weight.astype(np.float32)).reshape(weight.shape[0], -1)


def random_blocks(kind: str, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes a row]: random codes and packed scales, and fp16 fields ~ N(0, 1)."""
    generator = np.random.default_rng(seed)
    block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = generator.integers(0, 256, (rows, columns // block_elements, block_bytes), dtype=np.uint8)
    fields = generator.normal(0.0, 1.0, (rows, columns // block_elements, FP16_BYTES[kind] // 2))
    blocks[..., :FP16_BYTES[kind]] = fields.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _k_blocks(weight: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K super-blocks: per group of 32 a step (max - min) / (2^bits - 1) and a min <= 0, as 6-bit
    multiples sc, m of the super-block's fp16 d and dmin; value d sc q - dmin m."""
    top = 2 ** bits - 1
    groups = weight.reshape(-1, 8, 32)                                              # [super-blocks, 8, 32]
    low = np.minimum(groups.min(-1), 0.0)
    step = (groups.max(-1) - low) / top
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    sc = _multiples(step, d.astype(np.float32), 63)
    m = _multiples(-low, dmin.astype(np.float32), 63)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((groups + offset[..., None]) / np.where(scale == 0, 1, scale)[..., None]), 0, top)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)                                    # chunk c: groups 2c, 2c + 1
    qs = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
             _k_scales(sc.astype(np.uint8), m.astype(np.uint8))]
    if bits == 5:
        high = (q.reshape(-1, 8, 32) >> 4).astype(np.uint8)                         # bit s of byte j: group s, j
        parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8))
    return np.concatenate(parts + [qs.reshape(-1, 128)], axis=-1)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m uint8 [n, 8] (6 bits) -> the 12 bytes gguf's Q4_K.get_scale_min unpacks."""
    return np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                           (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=-1)


def _q6_k_blocks(weight: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks: ql (128 bytes), qh (64), an int8 scale per 16 elements (16), fp16 d; value d sc (q - 32)."""
    groups = weight.reshape(-1, 16, 16)
    step = np.abs(groups).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    sc = _multiples(step, d.astype(np.float32), 127)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(groups / np.where(scale == 0, 1, scale)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)                                      # element 128 h + r
    low, high = q & 0x0F, q >> 4
    ql = low[..., :64] | (low[..., 64:] << 4)                                       # byte 64 h + r % 64
    qh = sum(high[..., 32 * s:32 * (s + 1)] << (2 * s) for s in range(4)).astype(np.uint8)  # byte 32 h + r % 32
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d.view(np.uint8).reshape(-1, 2)], axis=-1)


def _multiples(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """values [n, groups] as float32 multiples 0..top of unit [n], at least 1 where a value is not 0."""
    safe = np.where(unit == 0, 1, unit)[:, None]
    multiples = np.clip(np.round(values / safe), 0, top)
    return np.where((values > 0) & (unit[:, None] > 0), np.maximum(multiples, 1), 0).astype(np.float32)
