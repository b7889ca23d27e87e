"""The SSM kernels (cuda_kernels/ssm.cu and activation.cu's) against the CPU backend's torch math (backend/cpu/ssm.py)
on the same bf16 inputs: segments of one token and of many, new (zero state) and continuing, one updated in place
(source slot = destination slot), at the shapes of the tiny test models and of Nemotron-H-8B's mixer."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cpu import ssm as reference  # noqa: E402
from metrale.runtime.backend.cuda.kernels import activation, ssm  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.backend.layer_math import SsmScan  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
SLOTS = 10
# (length, source slot, destination slot) of each segment: decode tokens, a new prompt, continuing chunks, a chunk
# longer than the scan's chunk, and one whose state is updated in place. No segment's destination is another's
# source (the engine never gives a forward such slots).
SEGMENTS = [(1, 0, 1), (1, -1, 2), (17, -1, 3), (5, 4, 5), (1, 6, 6), (40, 7, 8)]
# (heads, head_dim, n_groups, state_size, conv kernel): the tiny models' mixer, Nemotron-H-8B's, Falcon-H1's.
SHAPES = [(8, 16, 2, 16, 4), (128, 64, 8, 128, 4), (24, 64, 1, 256, 4)]


def device_segments(segments) -> tuple[ssm.Segments, SimpleNamespace, list]:
    """The kernels' segment arrays, the CPU math's view of the same batch (CpuBatch's fields), and the torch
    tensors behind the arrays (kept alive by the caller)."""
    lens = [n for n, _, _ in segments]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    kept = [as_int(starts), as_int(lens), as_int([s for _, s, _ in segments]), as_int([d for _, _, d in segments])]
    device = ssm.Segments(*(DeviceTensor.from_torch(t) for t in kept), len(segments), max(lens))
    single = [i for i, n in enumerate(lens) if n == 1]
    batch = SimpleNamespace(
        single_rows=torch.tensor([starts[i] for i in single], dtype=torch.int64),
        single_states=tuple(torch.tensor([segments[i][k] for i in single], dtype=torch.int64) for k in (1, 2)),
        multi_states=[(starts[i], lens[i], segments[i][1:]) for i in range(len(lens)) if lens[i] != 1])
    return device, batch, kept


def bf16(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE)).bfloat16()


@pytest.mark.parametrize("heads, head_dim, n_groups, state_size, width", SHAPES)
def test_conv_matches_the_cpu_math(kernel_library, stream, heads, head_dim, n_groups, state_size, width):
    torch.manual_seed(0)
    channels = heads * head_dim + 2 * n_groups * state_size
    segments, batch, _kept = device_segments(SEGMENTS)
    tokens = sum(n for n, _, _ in SEGMENTS)
    x, weight, bias = bf16(tokens, channels), bf16(channels, width, scale=0.5), bf16(channels)
    state = torch.randn(SLOTS, channels, width - 1, device=DEVICE).bfloat16().float()
    out = torch.full_like(x, float("nan"))
    ours = state.clone()
    torch.cuda.synchronize()
    ssm.conv(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
             DeviceTensor.from_torch(weight), DeviceTensor.from_torch(bias), DeviceTensor.from_torch(ours), segments)
    stream.sync()
    theirs = state.cpu()
    want = reference.conv(x.float().cpu(), weight.float().cpu(), bias.float().cpu(), batch, theirs)
    assert relative_error(out, want) < TOLERANCE[torch.bfloat16]
    assert torch.equal(ours.cpu(), theirs)           # the inputs kept, exactly


@pytest.mark.parametrize("heads, head_dim, n_groups, state_size, width", SHAPES)
def test_scan_matches_the_cpu_math(kernel_library, stream, heads, head_dim, n_groups, state_size, width):
    torch.manual_seed(1)
    inner = heads * head_dim
    segments, batch, _kept = device_segments(SEGMENTS)
    tokens = sum(n for n, _, _ in SEGMENTS)
    xbc, dt = bf16(tokens, inner + 2 * n_groups * state_size), bf16(tokens, heads)
    A = -torch.empty(heads, device=DEVICE).uniform_(0.05, 0.5)
    D, dt_bias = torch.randn(heads, device=DEVICE), torch.randn(heads, device=DEVICE) - 1.0
    state = 0.3 * torch.randn(SLOTS, heads, head_dim, state_size, device=DEVICE)
    y = torch.full((tokens, inner), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ours = state.clone()
    torch.cuda.synchronize()
    ssm.scan(kernel_library, stream, DeviceTensor.from_torch(y), DeviceTensor.from_torch(xbc),
             DeviceTensor.from_torch(dt), DeviceTensor.from_torch(A), DeviceTensor.from_torch(D),
             DeviceTensor.from_torch(dt_bias), DeviceTensor.from_torch(ours), segments, n_groups, 0.001, float("inf"))
    stream.sync()
    theirs = state.cpu()
    params = SsmScan(A.cpu(), D.cpu(), dt_bias.cpu(), heads, head_dim, n_groups, state_size, chunk_size=8,
                     dt_min=0.001)
    want = reference.scan(xbc.float().cpu(), dt.float().cpu(), params, batch, theirs)
    assert relative_error(y, want) < TOLERANCE[torch.bfloat16]
    assert relative_error(ours, theirs) < TOLERANCE[torch.float32]      # the states after each segment
    untouched = [slot for slot in range(SLOTS) if slot not in {d for *_, d in SEGMENTS}]
    assert torch.equal(ours[untouched].cpu(), state[untouched].cpu())


@pytest.mark.parametrize("width, group_size", [(128, 64), (8192, 1024), (2048, 2048)])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_norm_matches_the_cpu_math(kernel_library, stream, width, group_size, norm_before_gate):
    torch.manual_seed(2)
    x, gate, weight = bf16(37, width), bf16(37, width), bf16(width, scale=0.3) + 1
    out = torch.full_like(x, float("nan"))
    torch.cuda.synchronize()
    ssm.gated_norm(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                   DeviceTensor.from_torch(gate), DeviceTensor.from_torch(weight), 1e-5, group_size, norm_before_gate)
    stream.sync()
    want = reference.gated_rms_norm(x.double(), gate.double(), weight.double(), 1e-5, group_size, norm_before_gate)
    assert relative_error(out, want) < TOLERANCE[torch.bfloat16]


def test_the_hybrids_elementwise_ops(kernel_library, stream):
    torch.manual_seed(3)
    x, y = bf16(29, 4096, scale=2.0), bf16(29, 4096, scale=2.0)
    outs = [torch.full_like(x, float("nan")) for _ in range(3)]
    torch.cuda.synchronize()
    d = DeviceTensor.from_torch
    activation.relu_squared(kernel_library, stream, d(outs[0]), d(x))
    activation.add(kernel_library, stream, d(outs[1]), d(x), d(y))
    activation.mul_silu(kernel_library, stream, d(outs[2]), d(x), d(y))
    stream.sync()
    assert relative_error(outs[0], torch.relu(x.double()) ** 2) < TOLERANCE[torch.bfloat16]
    assert relative_error(outs[1], x.double() + y.double()) < TOLERANCE[torch.bfloat16]
    assert relative_error(outs[2], x.double() * torch.nn.functional.silu(y.double())) < TOLERANCE[torch.bfloat16]
