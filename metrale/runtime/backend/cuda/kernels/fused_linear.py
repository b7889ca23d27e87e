"""Launchers for cuda_kernels/fused_linear.cu: a decode step's linears with the layer norm before them or the
residual add after them fused in (sm_90 and later: the K splits of a tile meet in a thread block cluster)."""

import functools

import numpy as np

from metrale.runtime.backend.cuda.launch import ceil_div, launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "fused_linear"
THREADS = 128
TILE_N = 64          # output columns of a CTA, and the width of a row statistic
TILE_M = 64          # rows of a CTA
PASS_K = 256         # k staged at once
SPLITS = (1, 2, 4, 8)
# Rows at most that the backend runs fused (each lane's row statistics are sized for them): decode steps and beam
# searches; a prefill's linears are cuBLASLt's.
MAX_ROWS = 256
NULL = np.uint64(0)


@functools.lru_cache(maxsize=1024)
def plan_splits(m: int, n: int, k: int, sms: int) -> int | None:
    """How many CTAs share each output tile's K: the fewest that give at least half a CTA per SM with one pass
    each (K / splits <= PASS_K); failing that, the most. None where no split gives each CTA a share of K the kernel
    takes (see splits_take)."""
    ctas = (n // TILE_N) * ceil_div(m, TILE_M)
    valid = [s for s in SPLITS if splits_take(k, s)]
    if not valid:
        return None
    for s in valid:
        if k // s <= PASS_K and 2 * ctas * s >= sms:
            return s
    single_pass = [s for s in valid if k // s <= PASS_K]
    return single_pass[0] if single_pass else valid[-1]


def splits_take(k: int, splits: int) -> bool:
    """Whether each of `splits` CTAs can take an equal share of K: a power of two from 32 to PASS_K, or a multiple
    of PASS_K (its passes' 16-byte chunks then split evenly over the threads)."""
    if splits not in SPLITS or k % splits:
        return False
    share = k // splits
    return share % PASS_K == 0 or (32 <= share <= PASS_K and share & (share - 1) == 0)


def unsupported_reason(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None,
                       extra: tuple[DeviceTensor, ...] = ()) -> str | None:
    """Why a fused linear cannot run these operands, or None. extra: the residual, or the norm's weight and bias."""
    if len(x.shape) != 2 or x.dtype != "bfloat16":
        return f"x must be [M, K] bfloat16, not {x.shape} {x.dtype}"
    if len(weight.shape) != 2 or weight.dtype != "bfloat16" or not weight.is_contiguous:
        return f"weight must be a contiguous [N, K] bfloat16, not {weight.shape} {weight.dtype}"
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or n % TILE_N or k % 32 or n == 0:
        return f"x {x.shape} and weight {weight.shape} must agree on K % 32 == 0, with N % {TILE_N} == 0"
    if out.shape != (m, n) or out.dtype != "bfloat16" or out.stride % 4 or out.ptr % 8:
        return f"out must be an 8-byte aligned [{m}, {n}] bfloat16, not {out.shape} {out.dtype}"
    if (x.ptr | weight.ptr | 2 * x.stride) % 16:
        return "x and weight must be 16-byte aligned (pointer and row stride)"
    if bias is not None and (bias.shape != (n,) or bias.dtype != "bfloat16" or bias.ptr % 8):
        return f"bias must be an 8-byte aligned [{n}] bfloat16"
    for tensor in extra:
        if tensor.dtype != "bfloat16" or tensor.ptr % 16 or (len(tensor.shape) == 2 and tensor.stride % 8):
            return "the residual and the norm's vectors must be 16-byte aligned bfloat16"
    return None


def linear_norm(lib, stream, out: DeviceTensor, x: DeviceTensor, stats: DeviceTensor, norm_weight: DeviceTensor,
                norm_bias: DeviceTensor, eps: float, weight: DeviceTensor, bias: DeviceTensor | None, relu: bool,
                splits: int) -> None:
    """out [M, N] = [relu](layer_norm(x) @ weight.T + bias), x's row statistics from stats ([K / 64, M] float2,
    as linear_residual wrote them for x)."""
    m, k = x.shape
    require(k % TILE_N == 0 and norm_weight.shape == (k,) and norm_bias.shape == (k,),
            f"linear_norm: the norm's vectors must be [{k}], K a multiple of {TILE_N}")
    require(stats.dtype == "float32" and stats.numel >= 2 * m * (k // TILE_N),
            f"linear_norm: stats must hold [{k // TILE_N}, {m}] float2")
    _launch("fused_linear_norm_relu" if relu else "fused_linear_norm", lib, stream, out, x, weight, bias, splits,
            stats, norm_weight, norm_bias, np.float32(eps))


def linear_residual(lib, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
                    bias: DeviceTensor | None, residual: DeviceTensor, stats: DeviceTensor, splits: int) -> None:
    """out [M, N] = residual + bf16(x @ weight.T + bias); stats [N / 64, M] float2: each row's mean and sum of
    squared deviations over each 64 columns of out. out must not alias x or residual."""
    m, n = out.shape
    require(residual.shape == (m, n), f"linear_residual: residual must be [{m}, {n}], not {residual.shape}")
    require(stats.dtype == "float32" and stats.numel >= 2 * m * (n // TILE_N),
            f"linear_residual: stats must hold [{n // TILE_N}, {m}] float2")
    _launch("fused_linear_residual", lib, stream, out, x, weight, bias, splits, residual,
            np.int64(residual.stride), stats)


def _launch(name: str, lib, stream, out, x, weight, bias, splits: int, *middle) -> None:
    extra = tuple(a for a in middle if isinstance(a, DeviceTensor) and a.dtype == "bfloat16")
    problem = unsupported_reason(out, x, weight, bias, extra)
    require(problem is None, f"{name}: {problem}")
    m, k = x.shape
    require(splits_take(k, splits), f"{name}: {splits} splits do not share K = {k} as the kernel needs")
    if m == 0:
        return
    grid = (weight.shape[0] // TILE_N, 1, ceil_div(m, TILE_M))   # clusters of (1, splits, 1) CTAs when split
    launch_kernel(stream, lib.get(name, MODULE), grid, THREADS, out, np.int64(out.stride), x, np.int64(x.stride),
                  weight, bias if bias is not None else NULL, *middle, m, k, k // splits,
                  cluster=(1, splits, 1) if splits > 1 else None)
