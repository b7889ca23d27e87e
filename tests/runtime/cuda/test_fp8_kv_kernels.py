"""The CUDA kernels over an FP8 KV cache (--kv-dtype fp8): rope_and_write_kv's _fp8 entry writes exactly the bytes
the CPU backend writes (the rotated bf16 key or the value over its head's scale, rounded to nearest e4m3,
saturated); decode and prefill attention over e4m3 values with per-head scales against test_attention's float64
reference over the values the cache holds (value x scale); block copies move the bytes."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from test_attention import (DECODE_BATCHES, NAN, PREFILL_SEGMENTS, assert_close, paged_cache,  # noqa: E402
                            query_buffer, reference_attention, window_start)
from test_rope_kv import rope_tables  # noqa: E402
from metrale.runtime.backend.cuda.kernels.attention import (decode_workspace_elements,  # noqa: E402
                                                            paged_decode_attention, paged_prefill_attention)
from metrale.runtime.backend.cuda.kernels.rope_kv import copy_kv_prefixes, rope_and_write_kv  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor, Fp8KvTensor  # noqa: E402
from metrale.runtime.loading.fp8 import to_e4m3  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def head_scales(num_kv_heads: int, seed: int) -> torch.Tensor:
    """[2, kv_heads] float32: K's and V's scale for each head, spread over two decades; values past 448 x scale
    (a randn value past 0.03 x 448 at the smallest) saturate, as a checkpoint's too-small scale makes them."""
    generator = torch.Generator().manual_seed(seed)
    return (10.0 ** (torch.rand(2, num_kv_heads, generator=generator) * 2 - 3.5)).to(DEVICE)


def rounded(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [2, ..., kv_heads, head_dim] as an FP8 cache holds it, value x scale in float32 (NaN stays NaN)."""
    shape = (2,) + (1,) * (x.dim() - 3) + (scales.shape[1], 1)
    return to_e4m3(x.float() / scales.view(shape)).float() * scales.view(shape)


def fp8_cache(kv: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, Fp8KvTensor]:
    """kv [2, blocks, block_size, kv_heads, head_dim] in e4m3 over scales, and the cache layer the kernels take."""
    values = to_e4m3(kv.float() / scales.view(2, 1, 1, -1, 1))
    return values, Fp8KvTensor(values.data_ptr(), tuple(values.shape), "float8_e4m3",
                               scales=DeviceTensor.from_torch(scales))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 32), (32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("num_tokens", [1, 300])
@pytest.mark.parametrize("magnitude", ["saturating", "subnormal"])
def test_rope_and_write_kv_writes_the_cpu_backend_s_bytes(kernel_library, stream, num_heads, num_kv_heads, head_dim,
                                                          num_tokens, magnitude):
    """The bf16 kernel's rotated key and value, over the head's scale, rounded and saturated as loading/fp8.py's
    to_e4m3 does: equal bytes. q is rotated as by the bf16 kernel; padding slots write nothing. Values past 448 x
    the scale, or (scale 1) mostly below e4m3's smallest normal, 2^-6."""
    num_blocks, block_size = num_tokens // 16 + 3, 16
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, device=DEVICE).bfloat16()
    qkv[:, num_heads * head_dim:] *= 3.0 if magnitude == "saturating" else 0.01
    plain_qkv = qkv.clone()
    cos, sin = rope_tables(head_dim)
    positions = torch.randint(0, cos.shape[0], (num_tokens,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].int()
    if num_tokens > 1:
        slots[1] = -1
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    plain = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    values = torch.full(shape, 0x5a, dtype=torch.uint8, device=DEVICE)     # a byte no write leaves
    scales = (head_scales(num_kv_heads, seed=num_tokens) if magnitude == "saturating"
              else torch.ones(2, num_kv_heads, device=DEVICE))
    layer = Fp8KvTensor(values.data_ptr(), shape, "float8_e4m3", scales=DeviceTensor.from_torch(scales))
    torch.cuda.synchronize()
    for buffer, cache in ((plain_qkv, DeviceTensor.from_torch(plain)), (qkv, layer)):
        rope_and_write_kv(kernel_library, stream, DeviceTensor.from_torch(buffer), DeviceTensor.from_torch(cos),
                          DeviceTensor.from_torch(sin), DeviceTensor.from_torch(positions),
                          DeviceTensor.from_torch(slots), cache, num_heads, num_kv_heads, head_dim)
    stream.sync()
    assert torch.equal(qkv, plain_qkv)
    written = (slots >= 0).nonzero().flatten()
    flat_slots = slots[written].long()
    expected = to_e4m3(plain.view(2, -1, num_kv_heads, head_dim)[:, flat_slots].float()
                       / scales.view(2, 1, num_kv_heads, 1)).view(torch.uint8)
    got = values.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(got[:, flat_slots], expected)
    magnitudes = expected.view(torch.float8_e4m3fn).float().abs()
    assert (magnitudes == 448).any() if magnitude == "saturating" else (magnitudes[magnitudes > 0] < 2 ** -6).any()
    untouched = torch.ones(got.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[flat_slots] = False
    assert (got[:, untouched] == 0x5a).all()


def test_copy_kv_prefixes_moves_fp8_bytes(kernel_library, stream):
    layers, shape = 3, (2, 12, 16, 2, 64)
    pool = torch.randint(0, 256, (layers, *shape), dtype=torch.uint8, device=DEVICE)
    before = pool.clone()
    copies = torch.tensor([[1, 7, 5], [2, 8, 16], [1, 9, 1]], dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    copy_kv_prefixes(kernel_library, stream, [DeviceTensor(pool[i].data_ptr(), shape, "float8_e4m3")
                                              for i in range(layers)], DeviceTensor.from_torch(copies), 3)
    stream.sync()
    expected = before.clone()
    for src, dst, n in copies.tolist():
        expected[:, :, dst, :n] = before[:, :, src, :n]
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("batch", ["1", "7-mixed", "64-mixed"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (32, 8), (16, 1)], ids=["g1", "g4", "g16"])
@pytest.mark.parametrize("head_dim, block_size", [(32, 16), (64, 32), (128, 16), (128, 64)])
@pytest.mark.parametrize("sliding_window", [-1, 700])
@pytest.mark.parametrize("magnitude", ["saturating", "subnormal"])
def test_decode(kernel_library, stream, batch, num_heads, num_kv_heads, head_dim, block_size, sliding_window,
                magnitude):
    """The grouped kernel's _fp8 entry, whatever the group size (the multi-head kernels read bf16 only); values
    past 448 x their scales, or (scale 1) many below e4m3's smallest normal."""
    contexts = DECODE_BATCHES[batch]
    count, max_context = len(contexts), max(contexts)
    first_read = [window_start(c - 1, sliding_window) for c in contexts]
    kv, tables, sequences = paged_cache(contexts, first_read, block_size, num_kv_heads, head_dim, DEVICE,
                                        table_tokens=max_context)
    scales = head_scales(num_kv_heads, seed=count + head_dim)
    if magnitude == "subnormal":
        kv, sequences = kv * 0.02, [x * 0.02 for x in sequences]
        scales = torch.ones_like(scales)
    values, layer = fp8_cache(kv, scales)
    rows = torch.randperm(count + 5)[:count].to(torch.int32).to(DEVICE)
    q = query_buffer(count + 5, num_heads, num_kv_heads, head_dim, 1.0, DEVICE)
    out = torch.full((count + 5, num_heads * head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
    elements = decode_workspace_elements(kernel_library, count, num_heads, num_kv_heads, head_dim, max_context)
    workspace = torch.full((max(elements, 4),), NAN, dtype=torch.float32, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    torch.cuda.synchronize()
    paged_decode_attention(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(q), layer,
                           DeviceTensor.from_torch(rows), DeviceTensor.from_torch(context_lens),
                           DeviceTensor.from_torch(tables), DeviceTensor.from_torch(workspace), num_heads,
                           num_kv_heads, head_dim, scale, sliding_window, max_context)
    stream.sync()
    ours = torch.cat([out[int(rows[b])].view(1, num_heads, head_dim) for b in range(count)])
    reference = torch.cat([
        reference_attention(q[int(rows[b])].view(1, num_heads, head_dim), rounded(sequences[b], scales),
                            torch.tensor([c - 1], device=DEVICE), scale, sliding_window)
        for b, c in enumerate(contexts)])
    assert_close(ours, reference)
    # the scales matter: the bf16 values' attention is visibly apart
    plain = torch.cat([reference_attention(q[int(rows[b])].view(1, num_heads, head_dim), sequences[b],
                                           torch.tensor([c - 1], device=DEVICE), scale, sliding_window)
                       for b, c in enumerate(contexts)])
    assert relative_error(plain, reference) > TOLERANCE[torch.bfloat16] or magnitude == "subnormal"


@pytest.mark.parametrize("segments", ["37", "chunked", "mixed", "long", "empty-beside"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (32, 4)], ids=["g1", "g8"])
@pytest.mark.parametrize("head_dim, block_size", [(32, 16), (64, 64), (128, 16), (128, 32)])
@pytest.mark.parametrize("sliding_window", [-1, 100])
@pytest.mark.parametrize("magnitude", ["saturating", "subnormal"])
def test_prefill(kernel_library, stream, segments, num_heads, num_kv_heads, head_dim, block_size, sliding_window,
                 magnitude):
    """prefill_attention.cu's _fp8 kernel (on Hopper too: the wgmma kernel reads bf16 tiles through tensor maps),
    chunks over a cached context included."""
    segments = PREFILL_SEGMENTS[segments]
    query_lens, contexts = [n for n, _ in segments], [c for _, c in segments]
    first_read = [window_start(c - n, sliding_window) for n, c in segments]
    kv, tables, sequences = paged_cache(contexts, first_read, block_size, num_kv_heads, head_dim, DEVICE)
    scales = head_scales(num_kv_heads, seed=len(segments) + head_dim)
    if magnitude == "subnormal":
        kv, sequences = kv * 0.02, [x * 0.02 for x in sequences]
        scales = torch.ones_like(scales)
    values, layer = fp8_cache(kv, scales)
    starts, row = [], 1
    for n in query_lens:
        starts.append(row)
        row += n + 1
    q = query_buffer(row, num_heads, num_kv_heads, head_dim, 1.0, DEVICE)
    out = torch.full((row, num_heads * head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
    starts_device, lens_device, contexts_device = (torch.tensor(xs, dtype=torch.int32, device=DEVICE)
                                                   for xs in (starts, query_lens, contexts))
    scale = head_dim ** -0.5
    torch.cuda.synchronize()
    paged_prefill_attention(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(q), layer,
                            DeviceTensor.from_torch(starts_device), DeviceTensor.from_torch(lens_device),
                            DeviceTensor.from_torch(contexts_device), DeviceTensor.from_torch(tables), num_heads,
                            num_kv_heads, head_dim, scale, sliding_window, len(segments), max(query_lens))
    stream.sync()
    ours, reference = [], []
    untouched = torch.ones(row, dtype=torch.bool, device=DEVICE)
    for s, (n, context) in enumerate(segments):
        rows = slice(starts[s], starts[s] + n)
        positions = torch.arange(context - n, context, device=DEVICE)
        reference.append(reference_attention(q[rows].view(n, num_heads, head_dim), rounded(sequences[s], scales),
                                             positions, scale, sliding_window))
        ours.append(out[rows].view(n, num_heads, head_dim))
        untouched[rows] = False
    assert_close(torch.cat(ours), torch.cat(reference))
    assert out[untouched].isnan().all()
