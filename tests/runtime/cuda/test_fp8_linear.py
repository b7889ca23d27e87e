"""FP8 weights' linears on the GPU: the per-token quantization of an input (fp8.cu), and per token and 128 columns,
against torch's e4m3 cast; the skinny GEMM over an FP8 weight (a scale a row, or a row per 128 columns) against a
float64 reference over the weight it dequantizes to; cuBLASLt's W8A8 matmul (scaled a row, or a row per 128 columns)
and linears.fp8_linear_into against a float64 reference from the same quantized operands; the gated skinny GEMM of an
FP8 [gate; up] against the linear then its activation."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import relative_error  # noqa: E402
from metrale.runtime.backend.cuda import kernels  # noqa: E402
from metrale.runtime.backend.cuda.fp8_matrix import BLOCK, Fp8Matrix, device_scales  # noqa: E402
from metrale.runtime.backend.cuda.gemm import CublasLt  # noqa: E402
from metrale.runtime.backend.cuda.linears import fp8_linear_into  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.loading.fp8 import E4M3_MAX, Fp8Weight, quantize_rows  # noqa: E402
from fp8_checkpoints import quantized as block_quantized  # noqa: E402
from test_skinny_gemm import gated_pair  # noqa: E402

pytestmark = pytest.mark.gpu

# (N, K): Llama-3-8B's qkv, o, gate_up, down; a small model's; tails (N not a multiple of 16, K of 32).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 576), (1000, 208), (17, 16), (33, 4112)]
# A bf16 result rounds once: within a few bf16 units of the float64 product of the same operands.
BOUND = 1e-2


def fp8_weight(n: int, k: int, seed: int):
    """(the device Fp8Matrix and its torch tensors, the bf16 weight it dequantizes to) of a random [N, K] weight."""
    generator = torch.Generator().manual_seed(seed)
    quantized = quantize_rows(torch.randn(n, k, generator=generator) / k ** 0.5)
    data, scales = quantized.data.cuda(), quantized.scales.reshape(-1).cuda()
    matrix = Fp8Matrix(DeviceTensor.from_torch(data), DeviceTensor.from_torch(scales))
    return matrix, (data, scales), quantized.dequantize().to(torch.bfloat16).cuda()


def fp8_block_weight(n: int, k: int, seed: int):
    """fp8_weight's triple for a weight quantized in 128 x 128 blocks, as the releases are (K % 128 == 0): the
    Fp8Matrix holds a scale a row per 128 columns, [K / 128, N]."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) / k ** 0.5
    weight *= torch.logspace(-2, 2, n)[:, None] * torch.logspace(1, -1, k)[None, :]      # blocks of unlike scales
    quantized = Fp8Weight.of_checkpoint(*block_quantized(weight, (BLOCK, BLOCK)), (BLOCK, BLOCK))
    data, scales = quantized.data.cuda(), device_scales(quantized).cuda()
    matrix = Fp8Matrix(DeviceTensor.from_torch(data), DeviceTensor.from_torch(scales), blocks=True)
    return matrix, (data, scales), quantized.dequantize().to(torch.bfloat16).cuda()


def random_x(m: int, k: int, seed: int, pad: int = 0) -> torch.Tensor:
    """bf16 [M, K] (a column slice of [M, K + 2 pad] with pad), its rows at scales from 1e-3 to 1e3."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(m, k + 2 * pad, generator=generator, device="cuda")
    wide *= torch.logspace(-3, 3, m, device="cuda")[:, None]
    return wide.to(torch.bfloat16)[:, pad:pad + k]


def torch_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as loading/fp8.py quantizes a weight's: (e4m3 [M, K], float32 scales [M]), on the GPU. Computed on
    the CPU, whose division is IEEE's (torch's CUDA division by a number multiplies by its reciprocal)."""
    values = x.float().cpu()
    scales = values.abs().amax(dim=1) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = (values / scales[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.cuda(), scales.cuda()


def torch_group_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_quantized per 128 columns: (e4m3 [M, K], float32 scales [K / 128, M])."""
    m, k = x.shape
    values = x.float().cpu().view(m, k // BLOCK, BLOCK)
    scales = values.abs().amax(dim=2) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = (values / scales[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(m, k)
    return quantized.cuda(), scales.T.contiguous().cuda()


@pytest.fixture(scope="module")
def cublaslt(cuda_device):
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    yield lt
    lt.close()


@pytest.mark.parametrize("m, k, pad", [(1, 16, 0), (5, 4096, 0), (64, 14336, 0), (300, 576, 32)])
def test_quantize_rows_equals_torchs_cast(kernel_library, stream, m, k, pad):
    x = random_x(m, k, seed=m + k, pad=pad)
    x[m // 2] = 0                                        # a row of zeros: scale 1, all zeros
    q = torch.full((m, k), 0x7f, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)     # NaN
    scales = torch.full((m,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    kernels.fp8.quantize_rows(kernel_library, stream, DeviceTensor.from_torch(q), DeviceTensor.from_torch(scales),
                              DeviceTensor.from_torch(x))
    stream.sync()
    want_q, want_scales = torch_quantized(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m, k, pad", [(1, 128, 0), (5, 4096, 0), (33, 14336, 0), (300, 640, 32)])
def test_quantize_groups_equals_torchs_cast(kernel_library, stream, m, k, pad):
    x = random_x(m, k, seed=m + k, pad=pad)
    x[:, k - 128:] *= 1e-3                               # a group far below its row's largest
    x[m // 2, :128] = 0                                  # a group of zeros: scale 1, all zeros
    q = torch.full((m, k), 0x7f, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)     # NaN
    scales = torch.full((k // BLOCK, m), float("nan"), device="cuda")
    torch.cuda.synchronize()
    kernels.fp8.quantize_groups(kernel_library, stream, DeviceTensor.from_torch(q), DeviceTensor.from_torch(scales),
                                DeviceTensor.from_torch(x))
    stream.sync()
    want_q, want_scales = torch_group_quantized(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# (N, K) with K % 128 == 0: Llama-3-8B's qkv, o, gate_up, down; a small model's; N not a multiple of 16 or 128.
BLOCK_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 640), (1000, 256), (17, 256)]
# The two forms of an FP8 weight: (its weight maker, the input's quantization the W8A8 matmul takes, its shapes, the
# W8A8 matmul's row counts: multiples of 4 in blocks).
FORMS = {"row": (fp8_weight, torch_quantized, SHAPES, [17, 64, 300, 4096]),
         "blocks": (fp8_block_weight, torch_group_quantized, BLOCK_SHAPES, [20, 36, 64, 300, 4096])}


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("form, n, k", [(form, n, k) for form, (_, _, shapes, _) in FORMS.items() for n, k in shapes])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_skinny_fp8_is_the_linear_of_the_dequantized_weight(kernel_library, stream, form, m, n, k, relu):
    """W8A16: the weight widened to the bf16 values it dequantizes to, in registers (with each row's scale, or its
    scale for each 128 columns); fp32 accumulation."""
    matrix, _, dequantized = FORMS[form][0](n, k, seed=n + k)
    x = random_x(m, k, seed=m + 3 * k, pad=8 if m == 9 else 0)
    bias = torch.randn(n, device="cuda").bfloat16() if m % 2 else None
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    kernels.skinny_gemm.skinny_linear(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                                      matrix, DeviceTensor.from_torch(bias) if bias is not None else None, relu=relu)
    stream.sync()
    reference = x.double() @ dequantized.double().T + (bias.double() if bias is not None else 0)
    error = relative_error(out, reference.clamp_min(0) if relu else reference)
    assert error < BOUND, f"relative error {error:.2e}"


@pytest.mark.parametrize("form, half, k", [("row", 14336, 4096), ("row", 24, 208), ("blocks", 14336, 4096),
                                          ("blocks", 1536, 640), ("blocks", 24, 256)])
@pytest.mark.parametrize("m", [1, 9, 16])
def test_skinny_fp8_gated_is_the_linear_then_its_activation(kernel_library, stream, form, m, half, k):
    """A dense MLP's FP8 [gate; up] (Llama-3-8B's; small; a scale a row or a row per 128 columns): the gated kernel
    reads each half's rows and scales as the linear does, bit for bit the linear then silu_mul."""
    matrix, tensors, _ = FORMS[form][0](2 * half, k, seed=half + k)     # tensors: held while the kernels read them
    fused, apart = gated_pair(kernel_library, stream, random_x(m, k, seed=m + k), matrix)
    assert torch.isfinite(fused).all() and torch.equal(fused, apart)


def per_element(scales: torch.Tensor) -> torch.Tensor:
    """Scales [rows] (one a row) or [K / 128, rows] (a row's for each 128 columns) as a factor for each element of
    [rows, K], in float64."""
    return scales.double()[:, None] if scales.dim() == 1 else scales.double().T.repeat_interleave(BLOCK, 1)


def w8a8_reference(q_x, x_scales, data, scales, bias=None, relu=False) -> torch.Tensor:
    result = (q_x.double() * per_element(x_scales)) @ (data.double() * per_element(scales)).T
    result = result + bias.double() if bias is not None else result
    return result.clamp_min(0) if relu else result


@pytest.mark.parametrize("form, m, n, k", [(form, m, n, k) for form, (_, _, shapes, rows) in FORMS.items()
                                           for n, k in shapes[:6] for m in rows])
@pytest.mark.parametrize("with_bias, relu", [(False, False), (True, False), (True, True)])
def test_cublaslt_w8a8_matches_float64(cublaslt, stream, form, m, n, k, with_bias, relu):
    """Each operand scaled a row (OUTER_VEC_32F), or a row for each 128 columns (VEC128_32F, M a multiple of 4)."""
    make_weight, quantized, _, _ = FORMS[form]
    matrix, (data, scales), _ = make_weight(n, k, seed=n * k)
    q_x, x_scales = quantized(random_x(m, k, seed=m * n))
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    out = torch.full((m, n + 16), float("nan"), dtype=torch.bfloat16, device="cuda")[:, 8:8 + n]   # a column slice
    torch.cuda.synchronize()
    cublaslt.fp8_linear(stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(q_x),
                        DeviceTensor.from_torch(x_scales), matrix,
                        DeviceTensor.from_torch(bias) if bias is not None else None, relu=relu)
    stream.sync()
    error = relative_error(out, w8a8_reference(q_x, x_scales, data, scales, bias, relu))
    assert error < BOUND, f"relative error {error:.2e}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("m", [1, 16, 17, 200, 203])
def test_fp8_linear_into_quantizes_then_multiplies(kernel_library, cublaslt, stream, form, m):
    """Up to 16 rows the skinny GEMM (the dequantized weight's product); past them the input quantized per token
    (and 128 columns, in blocks) into the stream's buffer, then the W8A8 matmul: in blocks over rows in fours, the
    last M % 4 on the skinny GEMM."""
    n, k = 4096, 1024
    make_weight, quantized, _, _ = FORMS[form]
    matrix, (data, scales), dequantized = make_weight(n, k, seed=m)
    x = random_x(m, k, seed=2 * m, pad=16)
    buffer = torch.empty(256, 2048, dtype=torch.float8_e4m3fn, device="cuda")
    ctx = SimpleNamespace(stream=stream, gemm_workspace=None, fp8_input=DeviceTensor.from_torch(buffer),
                          fp8_scales=DeviceTensor.from_torch(torch.empty(256 * 2048 // BLOCK, device="cuda")))
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    fp8_linear_into(kernel_library, cublaslt, ctx, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x), matrix)
    stream.sync()
    body = 0 if m <= 16 else m - m % 4 if form == "blocks" else m
    reference = x.double() @ dequantized.double().T
    reference[:body] = w8a8_reference(*quantized(x[:body]), data, scales)
    error = relative_error(out, reference)
    assert error < BOUND, f"relative error {error:.2e}"
