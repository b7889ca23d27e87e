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
# (heads, head_dim, n_groups, state_size, conv kernel): the tiny models' mixer, Nemotron-H-8B's, Falcon-H1's, and the
# widest block the scan kernels take (head_dim 128: 1024 threads) with the largest state.
SHAPES = [(8, 16, 2, 16, 4), (128, 64, 8, 128, 4), (24, 64, 1, 256, 4), (4, 128, 2, 256, 4)]


def device_segments(segments) -> tuple[ssm.Segments, SimpleNamespace, list]:
    """The kernels' segment arrays, the CPU math's view of the same batch (CpuBatch's fields), and the torch
    tensors behind the arrays (kept alive by the caller)."""
    lens = [n for n, _, _ in segments]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    kept = [as_int(starts), as_int(lens), as_int([s for _, s, _ in segments]), as_int([d for _, _, d in segments])]
    device = ssm.Segments(*(DeviceTensor.from_torch(t) for t in kept), len(segments), max(lens, default=0))
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


# Long segments (a prefill's): one chunk and a bit, many chunks, an exact multiple, from zero and continuing.
LONG_SEGMENTS = [(9, 0, 1), (70, -1, 2), (300, 3, 3), (64, -1, 4)]
# scan() a token at a time over SEGMENTS; chunked_scan() over LONG_SEGMENTS in chunks of 8 and of 32 tokens.
SCANS = {"sequential": (SEGMENTS, 0), "chunks of 8": (LONG_SEGMENTS, 8), "chunks of 32": (LONG_SEGMENTS, 32)}


@pytest.mark.parametrize("scan", sorted(SCANS))
@pytest.mark.parametrize("heads, head_dim, n_groups, state_size, width", SHAPES)
def test_scan_matches_the_cpu_math(kernel_library, stream, heads, head_dim, n_groups, state_size, width, scan):
    torch.manual_seed(1)
    cases, chunk = SCANS[scan]
    inner = heads * head_dim
    segments, batch, _kept = device_segments(cases)
    tokens = sum(n for n, _, _ in cases)
    xbc, dt = bf16(tokens, inner + 2 * n_groups * state_size), bf16(tokens, heads)
    A = -torch.empty(heads, device=DEVICE).uniform_(0.05, 0.5)
    D, dt_bias = torch.randn(heads, device=DEVICE), torch.randn(heads, device=DEVICE) - 1.0
    state = 0.3 * torch.randn(SLOTS, heads, head_dim, state_size, device=DEVICE)
    y = torch.full((tokens, inner), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ours = state.clone()
    d = DeviceTensor.from_torch
    inputs = (d(y), d(xbc), d(dt), d(A), d(D), d(dt_bias), d(ours), segments, n_groups, 0.001, float("inf"))
    torch.cuda.synchronize()
    if chunk:
        # One slot more than chunk_slots: it must stay as it is (no chunk's slot past the count).
        slots = ssm.chunk_slots(tokens, segments, chunk)
        workspace = (torch.full((slots + 1, inner * state_size), float("nan"), device=DEVICE),
                     torch.full((slots + 1, heads), float("nan"), device=DEVICE))
        ssm.chunked_scan(kernel_library, stream, *inputs, chunk, *(d(t) for t in workspace))
        stream.sync()
        assert all(t[slots].isnan().all() for t in workspace)
    else:
        ssm.scan(kernel_library, stream, *inputs)
    stream.sync()
    theirs = state.cpu()
    params = SsmScan(A.cpu(), D.cpu(), dt_bias.cpu(), heads, head_dim, n_groups, state_size, chunk_size=chunk or 8,
                     dt_min=0.001)
    want = reference.scan(xbc.float().cpu(), dt.float().cpu(), params, batch, theirs)
    assert relative_error(y, want) < TOLERANCE[torch.bfloat16]
    assert relative_error(ours, theirs) < TOLERANCE[torch.float32]      # the states after each segment
    untouched = [slot for slot in range(SLOTS) if slot not in {d for *_, d in cases}]
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


def test_padding_segments_read_zeros_and_keep_nothing(kernel_library, stream):
    """A decode graph's padding rows (one token, slots -1) and a prefill graph's padding segments (no rows) beside
    the real ones: the real rows' outputs and every state slot as without them."""
    torch.manual_seed(4)
    heads, head_dim, n_groups, state_size, width = SHAPES[0]
    inner, tokens = heads * head_dim, sum(n for n, _, _ in SEGMENTS)
    channels = inner + 2 * n_groups * state_size
    x, weight, dt = bf16(tokens + 2, channels), bf16(channels, width, scale=0.5), bf16(tokens + 2, heads)
    A, D, dt_bias = -torch.rand(heads, device=DEVICE) - 0.05, torch.randn(heads, device=DEVICE), torch.zeros(
        heads, device=DEVICE)
    states = torch.randn(SLOTS, channels, width - 1, device=DEVICE), torch.randn(
        SLOTS, heads, head_dim, state_size, device=DEVICE)
    d = DeviceTensor.from_torch
    results = []
    for padding in ([], [(1, -1, -1), (1, -1, -1), (0, -1, -1)]):
        segments, _, _kept = device_segments(SEGMENTS + padding)
        conv_state, ssm_state = (state.clone() for state in states)
        conv_out, y = torch.zeros_like(x), torch.zeros(tokens + 2, inner, dtype=torch.bfloat16, device=DEVICE)
        torch.cuda.synchronize()
        ssm.conv(kernel_library, stream, d(conv_out), d(x), d(weight), None, d(conv_state), segments)
        ssm.scan(kernel_library, stream, d(y), d(conv_out), d(dt), d(A), d(D), d(dt_bias), d(ssm_state), segments,
                 n_groups, 0.0, float("inf"))
        stream.sync()
        results.append((conv_out[:tokens].clone(), y[:tokens].clone(), conv_state.clone(), ssm_state.clone()))
    for without, with_padding in zip(*results):
        assert torch.equal(without, with_padding)


def test_copy_slots_copies_whole_slots_of_every_tensor(kernel_library, stream):
    torch.manual_seed(6)
    tensors = [torch.randn(SLOTS, 40, 3, device=DEVICE), torch.randn(SLOTS, 8, 16, 16, device=DEVICE),
               torch.randn(SLOTS, 1000, 3, device=DEVICE)]
    before = [t.clone() for t in tensors]
    copies = [(0, 3), (5, 1), (7, 7)]
    as_int64 = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    words = [t[0].numel() * 4 // 16 for t in tensors]
    kept = [as_int64([t.data_ptr() for t in tensors]), as_int64(words),
            torch.tensor(copies, dtype=torch.int32, device=DEVICE)]
    table = ssm.StateTable(DeviceTensor.from_torch(kept[0]), DeviceTensor.from_torch(kept[1]), len(tensors),
                           max(words))
    torch.cuda.synchronize()
    ssm.copy_slots(kernel_library, stream, table, DeviceTensor.from_torch(kept[2]), len(copies))
    stream.sync()
    for tensor, old in zip(tensors, before):
        for src, dst in copies:
            old[dst] = old[src]
        assert torch.equal(tensor, old)
