"""cuBLASLt linear (out = x @ weight.T + bias) against a float64 torch reference from the same bf16 inputs."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.gemm import CublasLt  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.errors import FailedPrecondition  # noqa: E402

pytestmark = pytest.mark.gpu

WORKSPACE_BYTES = 32 << 20
TOKENS = [1, 7, 64, 300, 4096]
# (N, K): SmolLM2-135M's q/k/v-o and its 49152-row vocabulary, and 8B-class projections.
SHAPES = [(1536, 576), (49152, 576), (6144, 4096), (8192, 1024)]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_workspace():
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


@pytest.fixture(scope="module")
def cublaslt(cuda_device):
    workspace = make_workspace()
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    yield lt
    lt.close()


def random_linear(m: int, n: int, k: int, seed: int, with_bias: bool, x_pad: int = 0, bias_dtype=torch.bfloat16):
    """bf16 x [M, K] (a column slice of [M, K + x_pad] when x_pad), weight [N, K]; bias [N]; never zeros."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x_wide = torch.randn(m, k + x_pad, generator=generator, device="cuda").to(torch.bfloat16)
    x = x_wide[:, x_pad:]
    weight = (torch.randn(n, k, generator=generator, device="cuda") / k ** 0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator, device="cuda").to(bias_dtype) if with_bias else None
    return x, weight, bias


def reference(x, weight, bias):
    result = x.double() @ weight.double().T
    return result + bias.double() if bias is not None else result


def run_linear(lt, stream, out, x, weight, bias):
    torch.cuda.synchronize()    # torch made the inputs on its own stream
    lt.linear(stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x), DeviceTensor.from_torch(weight),
              DeviceTensor.from_torch(bias) if bias is not None else None)
    stream.sync()


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_linear_matches_float64(cublaslt, stream, m, n, k, with_bias, out_dtype):
    # The bias has out's dtype: cuBLASLt's BIAS epilogue takes no bf16 bias on float32 logits.
    x, weight, bias = random_linear(m, n, k, seed=m * 7 + n + k, with_bias=with_bias, bias_dtype=DTYPES[out_dtype])
    out = torch.full((m, n), float("nan"), dtype=DTYPES[out_dtype], device="cuda")
    run_linear(cublaslt, stream, out, x, weight, bias)
    error = relative_error(out, reference(x, weight, bias))
    assert error < TOLERANCE[out.dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_relu_epilogue_equals_relu_of_the_linear(cublaslt, stream, m, with_bias):
    # M2M100's fc1 at 64 rows (a beam step).
    n, k = 4096, 1024
    x, weight, bias = random_linear(m, n, k, seed=m + 5, with_bias=with_bias)
    plain = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fused = torch.full_like(plain, float("nan"))
    run_linear(cublaslt, stream, plain, x, weight, bias)
    torch.cuda.synchronize()
    cublaslt.linear(stream, DeviceTensor.from_torch(fused), DeviceTensor.from_torch(x), DeviceTensor.from_torch(weight),
                    DeviceTensor.from_torch(bias) if bias is not None else None, relu=True)
    stream.sync()
    assert (fused >= 0).all() and (fused == 0).any() and (fused > 0).any()
    error = relative_error(fused, reference(x, weight, bias).clamp(min=0))
    assert error < TOLERANCE[fused.dtype], f"relative error {error:.2e}"
    # cuBLASLt may take another algorithm for the epilogue: the sums may round differently, no more.
    assert relative_error(fused, torch.relu(plain).double()) < TOLERANCE[fused.dtype]


@pytest.mark.parametrize("m,n,k,splits,x_pad", [(64, 1024, 1024, 4, 0), (64, 1024, 4096, 8, 0), (16, 1024, 1024, 4, 0),
                                                 (9, 1536, 576, 2, 64)])
def test_split_partials_are_each_slices_product(cublaslt, stream, m, n, k, splits, x_pad):
    """splits > 1: partial i is x's K slice i times the weight's, in float32 (each against float64), as the rows
    i * M .. of out; no bias (the norm after them adds it)."""
    x, weight, _ = random_linear(m, n, k, seed=m + splits, with_bias=False, x_pad=x_pad)
    out = torch.full((splits * m, n), float("nan"), dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    cublaslt.linear(stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x), DeviceTensor.from_torch(weight),
                    splits=splits)
    stream.sync()
    width = k // splits
    for i in range(splits):
        part = slice(i * width, (i + 1) * width)
        expected = reference(x[:, part], weight[:, part], None)
        error = relative_error(out[i * m:(i + 1) * m], expected)
        assert error < TOLERANCE[torch.float32], f"partial {i}: relative error {error:.2e}"
    assert relative_error(out.view(splits, m, n).sum(0), reference(x, weight, None)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("m,heads,n,k,x_head,out_head", [(1, 16, 512, 128, 192, 576), (300, 16, 512, 128, 192, 576),
                                                      (64, 128, 128, 512, 512, 128), (7, 4, 32, 16, 32, 48)])
def test_head_linear_is_each_heads_product(cublaslt, stream, m, heads, n, k, x_head, out_head):
    """Multi-head latent attention's per-head projections: each head's columns of x (every x_head elements) times
    its own weight into its columns of out (every out_head); the columns between stay as they were."""
    generator = torch.Generator(device="cuda").manual_seed(m + heads)
    x = torch.randn(m, heads * x_head, generator=generator, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(heads, n, k, generator=generator, device="cuda") / k ** 0.5).to(torch.bfloat16)
    out = torch.full((m, heads * out_head), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    cublaslt.head_linear(stream, DeviceTensor.from_torch(out).columns(0, n), DeviceTensor.from_torch(x).columns(0, k),
                         DeviceTensor.from_torch(weight), x_head, out_head)
    stream.sync()
    got = out.view(m, heads, out_head)
    expected = torch.einsum("mhk,hnk->mhn", x.view(m, heads, x_head)[..., :k].double(), weight.double())
    assert relative_error(got[..., :n], expected) < TOLERANCE[torch.bfloat16]
    assert got[..., n:].isnan().all()
    # The same weights stored [heads, K, N]
    out.fill_(float("nan"))
    stored = weight.transpose(1, 2).contiguous()
    torch.cuda.synchronize()
    cublaslt.head_linear(stream, DeviceTensor.from_torch(out).columns(0, n), DeviceTensor.from_torch(x).columns(0, k),
                         DeviceTensor.from_torch(stored), x_head, out_head, transposed=True)
    stream.sync()
    assert relative_error(got[..., :n], expected) < TOLERANCE[torch.bfloat16] and got[..., n:].isnan().all()


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("m", [1, 300])
def test_linear_reads_and_writes_column_slices(cublaslt, stream, m, out_dtype):
    n, k = 1536, 576
    x, weight, bias = random_linear(m, n, k, seed=11, with_bias=True, x_pad=64,    # x: row stride K + 64
                                    bias_dtype=DTYPES[out_dtype])
    out_wide = torch.full((m, n + 3 * 64), float("nan"), dtype=DTYPES[out_dtype], device="cuda")
    out = out_wide[:, 64:64 + n]                                                    # out: row stride N + 192
    run_linear(cublaslt, stream, out, x, weight, bias)
    error = relative_error(out, reference(x, weight, bias))
    assert error < TOLERANCE[out.dtype], f"relative error {error:.2e}"
    assert out_wide[:, :64].isnan().all() and out_wide[:, 64 + n:].isnan().all()


def test_descriptors_are_built_once_per_shape(cuda_device, stream):
    workspace = make_workspace()
    with CublasLt(DeviceTensor.from_torch(workspace)) as lt:
        for seed in (1, 2):     # the second call has new inputs at new addresses, and must reuse the plan
            x, weight, _ = random_linear(64, 1536, 576, seed=seed, with_bias=False)
            out = torch.full((64, 1536), float("nan"), dtype=torch.bfloat16, device="cuda")
            run_linear(lt, stream, out, x, weight, None)
            assert relative_error(out, reference(x, weight, None)) < TOLERANCE[torch.bfloat16]
            assert lt.plans_created == 1
        x, weight, bias = random_linear(64, 1536, 576, seed=3, with_bias=True)
        run_linear(lt, stream, out, x, weight, bias)
        assert lt.plans_created == 2    # a bias is another epilogue: another descriptor
        run_linear(lt, stream, out[:7], x[:7], weight, bias)
        assert lt.plans_created == 3    # another M


def test_biased_calls_of_one_shape_keep_their_own_bias(cublaslt, stream):
    """Two biased linears of one shape enqueued back to back share a descriptor whose bias pointer the second
    call overwrites; the first must still have used its own bias."""
    x, weight, first_bias = random_linear(7, 1536, 576, seed=5, with_bias=True, bias_dtype=torch.float32)
    second_bias = -2 * first_bias
    outs = [torch.full((7, 1536), float("nan"), dtype=torch.float32, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    for out, bias in zip(outs, (first_bias, second_bias)):
        cublaslt.linear(stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                        DeviceTensor.from_torch(weight), DeviceTensor.from_torch(bias))
    stream.sync()
    for out, bias in zip(outs, (first_bias, second_bias)):
        assert relative_error(out, reference(x, weight, bias)) < TOLERANCE[torch.float32]


def test_linear_replays_inside_a_cuda_graph(cublaslt, stream):
    """Decode is graph-captured: a linear captured once (its first call of this shape builds the plan during the
    capture, which is host-only work) replays on new inputs written into the same buffers."""
    m, n, k = 5, 1536, 576
    x, weight, bias = random_linear(m, n, k, seed=21, with_bias=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    builder = stream.create_graph_builder()
    builder.begin_building()
    cublaslt.linear(builder.stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                    DeviceTensor.from_torch(weight), DeviceTensor.from_torch(bias))
    graph = builder.end_building().complete()
    try:
        for seed in (22, 23):
            new_x, _, _ = random_linear(m, n, k, seed=seed, with_bias=False)
            x.copy_(new_x)
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            graph.launch(stream)
            stream.sync()
            assert relative_error(out, reference(x, weight, bias)) < TOLERANCE[torch.bfloat16]
    finally:
        graph.close()
        builder.close()


def test_close_is_idempotent_and_final(cuda_device, stream):
    workspace = make_workspace()
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    x, weight, _ = random_linear(7, 1536, 576, seed=9, with_bias=False)
    out = torch.empty((7, 1536), dtype=torch.bfloat16, device="cuda")
    run_linear(lt, stream, out, x, weight, None)
    lt.close()
    lt.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        run_linear(lt, stream, out, x, weight, None)


def test_tuner_times_each_new_shape_once_and_its_choice_stays_exact(stream):
    """gemm_tuning.AlgoTuner: a new shape's candidates are timed (over weight copies in the scratch) and the fastest
    kept, the heuristic's first where none beats it; the call's result is still the linear's; a shape met again, and
    a weight too small to matter, are not timed."""
    from metrale.runtime.backend.cuda.gemm_tuning import AlgoTuner

    workspace, scratch = make_workspace(), torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    lt = CublasLt(DeviceTensor.from_torch(workspace))
    tuner = lt.tuner = AlgoTuner(DeviceTensor.from_torch(scratch), torch.cuda.get_device_properties(0).L2_cache_size)
    try:
        x, weight, bias = random_linear(4, 1024, 1024, seed=11, with_bias=True)   # NLLB's out projection, 4 rows
        for _ in range(2):
            out = torch.full((4, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
            run_linear(lt, stream, out, x, weight, bias)
            assert relative_error(out, reference(x, weight, bias)) < TOLERANCE[torch.bfloat16]
        assert len(tuner.chosen) == 1
        (index, times), = tuner.chosen.values()
        assert len(times) >= 1 and all(t > 0 for t in times)
        assert index == 0 or times[index] < times[0]
        small_x, small_weight, _ = random_linear(4, 256, 256, seed=12, with_bias=False)
        run_linear(lt, stream, torch.empty(4, 256, dtype=torch.bfloat16, device="cuda"), small_x, small_weight, None)
        assert len(tuner.chosen) == 1
    finally:
        lt.close()
