"""activation.cu against a float64 torch reference: silu(gate) * up, and ReLU."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.kernels.activation import relu, silu_mul  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("intermediate", [96, 11008, 14336])
def test_silu_mul_matches_float64(kernel_library, stream, num_tokens, intermediate):
    gate_up = (2 * torch.randn(num_tokens, 2 * intermediate, device=DEVICE)).bfloat16()
    out = torch.full((num_tokens, intermediate), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    torch.cuda.synchronize()
    silu_mul(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(gate_up))
    stream.sync()
    gate, up = gate_up.double().chunk(2, dim=-1)
    reference = torch.nn.functional.silu(gate) * up
    assert relative_error(out, reference) < TOLERANCE[torch.bfloat16]


def test_silu_mul_strided_out(kernel_library, stream):
    # out a column slice of a wider buffer: the columns beyond it keep their poison.
    gate_up = torch.randn(13, 2 * 256, device=DEVICE).bfloat16()
    out_wide = torch.full((13, 256 + 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = out_wide[:, :256]
    torch.cuda.synchronize()
    silu_mul(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(gate_up))
    stream.sync()
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert relative_error(out, torch.nn.functional.silu(gate) * up) < TOLERANCE[torch.bfloat16]
    assert out_wide[:, 256:].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("width", [96, 4096])
def test_relu_matches_torch(kernel_library, stream, num_tokens, width):
    # x a column slice of a wider buffer, out strided too: the columns beyond them keep their poison.
    x = (2 * torch.randn(num_tokens, width + 32, device=DEVICE)).bfloat16()[:, :width]
    out_wide = torch.full((num_tokens, width + 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    torch.cuda.synchronize()
    relu(kernel_library, stream, DeviceTensor.from_torch(out_wide[:, :width]), DeviceTensor.from_torch(x))
    stream.sync()
    assert torch.equal(out_wide[:, :width], torch.relu(x))      # exact: max(x, 0) needs no rounding
    assert (x < 0).any() and out_wide[:, width:].isnan().all()
