"""gemv.cu's skinny GEMM (out = x @ weight.T + bias, M <= 16) against a float64 torch reference from the same bf16
inputs, and its gated form against the GEMM then the activation; and its launcher's checks, which need no GPU."""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.compiler import kernel_sources  # noqa: E402
from metrale.runtime.backend.cuda.kernels import skinny_gemm  # noqa: E402
from metrale.runtime.backend.cuda.kernels.activation import silu_mul  # noqa: E402
from metrale.runtime.backend.cuda.kernels.skinny_gemm import skinny_linear, supports  # noqa: E402
from metrale.runtime.backend.cuda.launch import ceil_div, kernel_arg  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

gpu = pytest.mark.gpu
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TOKENS = [1, 2, 3, 5, 8, 13, 16]
# (N, K, out dtype): Llama-3-8B's qkv, o, gate_up, down; SmolLM2-135M's qkv, down and vocabulary (logits: float32).
SHAPES = [(6144, 4096, "bfloat16"), (4096, 4096, "bfloat16"), (28672, 4096, "bfloat16"), (4096, 14336, "bfloat16"),
          (960, 576, "bfloat16"), (576, 1536, "bfloat16"), (49152, 576, "float32")]
# Tails: N not a multiple of 16, K not a multiple of 32, K shorter than the 8 warps' share (most warps idle).
EDGE_SHAPES = [(1000, 200), (17, 8), (33, 4104), (24, 520)]


@pytest.fixture(scope="module")
def weights():
    """(N, K) -> bf16 weight [N, K], random, made once per shape."""
    made = {}

    def weight(n: int, k: int) -> torch.Tensor:
        if (n, k) not in made:
            generator = torch.Generator(device="cuda").manual_seed(n + 7 * k)
            made[n, k] = (torch.randn(n, k, generator=generator, device="cuda") / k ** 0.5).to(torch.bfloat16)
        return made[n, k]

    return weight


def random_x(m: int, k: int, seed: int, pad: int = 0) -> torch.Tensor:
    """bf16 [M, K], never zeros; with pad, a column slice at column pad of a [M, K + 2 pad] buffer."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(m, k + 2 * pad, generator=generator, device="cuda").to(torch.bfloat16)
    return wide[:, pad:pad + k]


def poisoned(m: int, n: int, dtype: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, N], the [M, N + 2 pad] buffer it is a column slice of), all NaN."""
    wide = torch.full((m, n + 2 * pad), float("nan"), dtype=DTYPES[dtype], device="cuda")
    return wide[:, pad:pad + n], wide


def run(lib, stream, out, x, weight, bias=None):
    torch.cuda.synchronize()    # torch made the inputs on its own stream
    skinny_linear(lib, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                  DeviceTensor.from_torch(weight), DeviceTensor.from_torch(bias) if bias is not None else None)
    stream.sync()


def check(out, x, weight, bias=None):
    reference = x.double() @ weight.double().T
    if bias is not None:
        reference += bias.double()
    error = relative_error(out, reference)
    assert error < TOLERANCE[out.dtype], f"relative error {error:.2e}"


@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_relu_epilogue_is_the_relu_of_the_linear(kernel_library, stream, weights, m):
    # M2M100's fc1 at a decode batch's rows (bias, then max(., 0) before the one rounding).
    weight, x = weights(4096, 1024), random_x(m, 1024, seed=m + 3)
    bias = torch.randn(4096, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda").bfloat16()
    out, _ = poisoned(m, 4096, "bfloat16")
    torch.cuda.synchronize()
    skinny_linear(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                  DeviceTensor.from_torch(weight), DeviceTensor.from_torch(bias), relu=True)
    stream.sync()
    reference = (x.double() @ weight.double().T + bias.double()).clamp_min(0)
    assert (out >= 0).all() and (out == 0).any()
    assert relative_error(out, reference) < TOLERANCE[out.dtype]


@gpu
@pytest.mark.parametrize("n, k, out_dtype", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_skinny_linear_matches_float64(kernel_library, stream, weights, m, n, k, out_dtype):
    weight, x = weights(n, k), random_x(m, k, seed=m * 31 + n + k)
    out, _ = poisoned(m, n, out_dtype)
    run(kernel_library, stream, out, x, weight)
    check(out, x, weight)


@gpu
@pytest.mark.parametrize("n, k", EDGE_SHAPES)
@pytest.mark.parametrize("m", [1, 9, 16])
def test_skinny_linear_tails(kernel_library, stream, weights, m, n, k):
    weight, x = weights(n, k), random_x(m, k, seed=m + n + k)
    out, _ = poisoned(m, n, "float32")
    run(kernel_library, stream, out, x, weight)
    check(out, x, weight)


@gpu
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("n, k", [(960, 576), (4096, 4096)])
@pytest.mark.parametrize("m", [1, 13])
def test_skinny_linear_adds_bias(kernel_library, stream, weights, m, n, k, out_dtype):
    weight, x = weights(n, k), random_x(m, k, seed=5 * m + k)
    bias = torch.randn(n, device="cuda").to(DTYPES[out_dtype])
    out, _ = poisoned(m, n, out_dtype)
    run(kernel_library, stream, out, x, weight, bias)
    check(out, x, weight, bias)


@gpu
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("m", [3, 16])
def test_skinny_linear_reads_and_writes_column_slices(kernel_library, stream, weights, m, out_dtype):
    n, k = 960, 576
    weight, x = weights(n, k), random_x(m, k, seed=m, pad=64)       # x: row stride K + 128
    bias = torch.randn(n, device="cuda").to(DTYPES[out_dtype])
    out, out_wide = poisoned(m, n, out_dtype, pad=64)                # out: row stride N + 128
    run(kernel_library, stream, out, x, weight, bias)
    check(out, x, weight, bias)
    assert out_wide[:, :64].isnan().all() and out_wide[:, 64 + n:].isnan().all()


def gated_pair(lib, stream, x, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(skinny_gated's out, skinny_linear's [M, 2 I] then activation.silu_mul's) for x and weight [gate; up] (bf16,
    or an Fp8Matrix); both poisoned first."""
    m, half = x.shape[0], weight.shape[0] // 2
    fused, _ = poisoned(m, half, "bfloat16")
    product, _ = poisoned(m, 2 * half, "bfloat16")
    apart, _ = poisoned(m, half, "bfloat16")
    device_x = DeviceTensor.from_torch(x)
    device_weight = weight if not isinstance(weight, torch.Tensor) else DeviceTensor.from_torch(weight)
    torch.cuda.synchronize()
    skinny_gemm.skinny_gated(lib, stream, DeviceTensor.from_torch(fused), device_x, device_weight)
    skinny_linear(lib, stream, DeviceTensor.from_torch(product), device_x, device_weight)
    silu_mul(lib, stream, DeviceTensor.from_torch(apart), DeviceTensor.from_torch(product))
    stream.sync()
    return fused, apart


@gpu
@pytest.mark.parametrize("half, k", [(14336, 4096), (1536, 576), (24, 200), (8, 64)])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
def test_gated_gate_up_is_the_linear_then_its_activation(kernel_library, stream, weights, m, half, k):
    """A dense MLP's [gate; up] (Llama-3-8B's, SmolLM2's, three CTAs' worth, one CTA's): bit for bit the skinny GEMM
    then silu_mul, and silu(gate) * up of the float64 product within bf16's rounding."""
    weight, x = weights(2 * half, k), random_x(m, k, seed=m + half + k, pad=8)
    fused, apart = gated_pair(kernel_library, stream, x, weight)
    assert torch.equal(fused, apart)
    gate, up = (x.double() @ weight.double().T).chunk(2, dim=1)
    assert relative_error(fused, torch.nn.functional.silu(gate) * up) < 2 * TOLERANCE[fused.dtype]


# The launcher without a GPU: made-up addresses, a library that hands out names, launch_kernel recorded.
BASE = 1 << 32


def bf16(*shape, offset=0, row_stride=None):
    return DeviceTensor(BASE + offset, shape, "bfloat16", row_stride)


def f32(*shape, offset=0, row_stride=None):
    return DeviceTensor(BASE + offset, shape, "float32", row_stride)


class FakeLibrary:
    def __init__(self):
        self.requested = []

    def get(self, kernel_name, module):
        self.requested.append((module, kernel_name))
        return kernel_name


@pytest.fixture
def launches(monkeypatch):
    recorded = []

    def record(stream, kernel, grid, block, *args, shmem=0):
        recorded.append((kernel, grid, block, args))

    monkeypatch.setattr(skinny_gemm, "launch_kernel", record)
    return recorded


def parameter_types(kernel: str) -> list[type]:
    """The numpy type kernel_arg must produce for each parameter of `kernel` in gemv.cu."""
    parameters = re.search(rf"\b{kernel}\(([^)]*)\)", kernel_sources()["gemv"]).group(1)
    types = []
    for parameter in parameters.split(","):
        declaration = " ".join(parameter.split())
        types.append(np.uint64 if "*" in declaration else np.int64 if declaration.startswith("long long ")
                     else np.int32 if declaration.startswith("int ") else None)
    return types


M, N, K = 4, 4096, 4096
BAD_CALLS = {
    "M over 16": (bf16(17, N), bf16(17, K), bf16(N, K), None),
    "K not a multiple of 8": (bf16(M, N), bf16(M, 100), bf16(N, 100), None),
    "float32 x": (bf16(M, N), f32(M, K), bf16(N, K), None),
    "1-D x": (bf16(M, N), bf16(K), bf16(N, K), None),
    "float32 weight": (bf16(M, N), bf16(M, K), f32(N, K), None),
    "strided weight": (bf16(M, N), bf16(M, K), bf16(N, K, row_stride=K + 8), None),
    "K disagrees": (bf16(M, N), bf16(M, K), bf16(N, K + 8), None),
    "out rows": (bf16(M + 1, N), bf16(M, K), bf16(N, K), None),
    "out columns": (bf16(M, N - 8), bf16(M, K), bf16(N, K), None),
    "float16 out": (DeviceTensor(BASE, (M, N), "float16"), bf16(M, K), bf16(N, K), None),
    "misaligned x": (bf16(M, N), bf16(M, K, offset=8), bf16(N, K), None),
    "x row stride not 16-byte": (bf16(M, N), bf16(M, K, row_stride=K + 4), bf16(N, K), None),
    "misaligned weight": (bf16(M, N), bf16(M, K), bf16(N, K, offset=2), None),
    "odd out pointer": (f32(M, N, offset=2), bf16(M, K), bf16(N, K), None),
    "bfloat16 bias on float32 out": (f32(M, N), bf16(M, K), bf16(N, K), bf16(N)),
    "bias length": (bf16(M, N), bf16(M, K), bf16(N, K), bf16(N + 8)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_are_rejected_before_any_kernel(case, launches):
    out, x, weight, bias = BAD_CALLS[case]
    lib = FakeLibrary()
    assert not supports(x, weight, out, bias)
    with pytest.raises(InvalidArgument, match="skinny_linear"):
        skinny_linear(lib, None, out, x, weight, bias)
    assert lib.requested == [] and launches == []


@pytest.mark.parametrize("m, out, kernel", [
    (1, bf16(1, 6144), "skinny_gemm_m8_bf16"), (8, bf16(8, 6144), "skinny_gemm_m8_bf16"),
    (9, bf16(9, 6144), "skinny_gemm_m16_bf16"), (16, f32(16, 6144, row_stride=6144 + 64), "skinny_gemm_m16_f32"),
    (5, f32(5, 6144), "skinny_gemm_m8_f32")])
def test_skinny_linear_launch(launches, m, out, kernel):
    x = bf16(m, 4096, row_stride=4096 + 128)
    assert supports(x, bf16(6144, 4096), out)
    skinny_linear(FakeLibrary(), None, out, x, bf16(6144, 4096))
    [(name, grid, block, args)] = launches
    assert (name, grid, block) == (kernel, ceil_div(6144, 16), 256)
    converted = [kernel_arg(a) for a in args]
    assert [type(a) for a in converted] == parameter_types(kernel)
    assert converted[1] == out.stride and converted[3] == (4096 + 128) // 8
    assert converted[5] == 0 and converted[6:] == [m, 6144, 4096 // 8, 0]   # no bias: a null pointer; no relu


def test_skinny_linear_with_no_tokens_launches_nothing(launches):
    lib = FakeLibrary()
    skinny_linear(lib, None, bf16(0, N), bf16(0, K), bf16(N, K))
    assert lib.requested == [] and launches == []
