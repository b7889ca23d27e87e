"""decode_attention.cu and prefill_attention.cu against a float64 reference (explicit gather through the block table, masked softmax).

Every cache element no query may read is NaN (unassigned blocks, block 0 that pads the tables, slots past a
context, keys before a sliding window), and so is every output row the kernels must not write: a read of the
wrong block or slot, or a stray write, shows as NaN or as a wrong row. Errors are checked over all rows and
for the worst (row, head), so a fragment-layout or masking bug that touches a few rows still fails.
"""

import math

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cpu import CpuLayerMath  # noqa: E402
from metrale.runtime.backend.cuda.kernels.attention import (decode_workspace_elements,  # noqa: E402
                                                            paged_decode_attention, paged_prefill_attention)
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.batch import ForwardBatch  # noqa: E402

DEVICE = "cuda"
NAN = float("nan")


def paged_cache(contexts, first_read, block_size, num_kv_heads, head_dim, device, poison=True, table_tokens=0):
    """A KV cache whose blocks are shuffled among the sequences and block tables padded with block 0 (never a
    sequence's), wide enough for table_tokens tokens and one block more than the longest context.
    Keys [first_read[s], contexts[s]) of sequence s are random; with poison, all else is NaN.
    Returns kv [2, num_blocks, block_size, kvh, hd], block_tables [S, max_blocks] int32 and each sequence's
    K/V [2, context, kvh, hd] as the reference reads it."""
    counts = [math.ceil(c / block_size) for c in contexts]
    num_blocks = 1 + sum(counts) + 3
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    fill = NAN if poison else 0.0
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=torch.bfloat16, device=device)
    if not poison:
        kv.normal_()
    width = max(max(counts) + 1, math.ceil(table_tokens / block_size))
    tables = torch.zeros((len(contexts), width), dtype=torch.int32)
    sequences = []
    for s, (context, count) in enumerate(zip(contexts, counts)):
        ids, order = order[:count], order[count:]
        tables[s, :count] = torch.tensor(ids, dtype=torch.int32)
        data = torch.randn(2, count * block_size, num_kv_heads, head_dim, device=device).bfloat16()
        if poison:
            data[:, :first_read[s]] = NAN
            data[:, context:] = NAN
        kv[:, ids] = data.view(2, count, block_size, num_kv_heads, head_dim)
        sequences.append(kv[:, ids].reshape(2, count * block_size, num_kv_heads, head_dim)[:, :context])
    return kv, tables.to(device), sequences


def reference_attention(q, keys_values, positions, scale, sliding_window):
    """q [n, H, hd] at positions [n] over keys_values [2, C, kvh, hd] -> [n, H, hd] float64; causal, windowed
    when sliding_window > 0. Keys no query may see are NaN in keys_values; they are masked, then zeroed."""
    group = q.shape[1] // keys_values.shape[2]
    keys, values = torch.nan_to_num(keys_values.double(), nan=0.0).repeat_interleave(group, dim=2)
    key_positions = torch.arange(keys.shape[0], device=q.device)
    allowed = key_positions[None, :] <= positions[:, None]
    if sliding_window > 0:
        allowed &= key_positions[None, :] > positions[:, None] - sliding_window
    scores = torch.einsum("nhd,chd->hnc", q.double(), keys) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.einsum("hnc,chd->nhd", probs, values)


def assert_close(ours, reference):
    """ours, reference [n, H, hd]: the whole and the worst (row, head) within bf16 bounds."""
    assert relative_error(ours, reference) < TOLERANCE[torch.bfloat16]
    ours, reference = ours.double(), reference.double()
    worst = ((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max()
    assert worst < 2 * TOLERANCE[torch.bfloat16], f"worst (row, head) relative error {worst:.3g}"


def query_buffer(num_rows, num_heads, num_kv_heads, head_dim, sharpness, device):
    """q [T, H * hd]: a column slice of a qkv-shaped buffer, as the model hands it over."""
    qkv = torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    return (sharpness * qkv).bfloat16()[:, :num_heads * head_dim]


def window_start(position, sliding_window):
    return max(0, position - sliding_window + 1) if sliding_window > 0 else 0


def run_decode(lib, stream, contexts, num_heads, num_kv_heads, head_dim, block_size, sliding_window,
               max_context=None, sharpness=1.0):
    batch = len(contexts)
    max_context = max_context or max(contexts)
    first_read = [window_start(c - 1, sliding_window) for c in contexts]
    kv, tables, sequences = paged_cache(contexts, first_read, block_size, num_kv_heads, head_dim, DEVICE,
                                        table_tokens=max_context)
    # rows of T in a shuffled order, with rows no sequence owns
    num_rows = batch + 5
    rows = torch.randperm(num_rows)[:batch].to(torch.int32).to(DEVICE)
    q = query_buffer(num_rows, num_heads, num_kv_heads, head_dim, sharpness, DEVICE)
    out = torch.full((num_rows, num_heads * head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
    elements = decode_workspace_elements(lib, batch, num_heads, num_kv_heads, head_dim, max_context)
    workspace = torch.full((max(elements, 4),), NAN, dtype=torch.float32, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    torch.cuda.synchronize()
    paged_decode_attention(lib, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(q),
                           DeviceTensor.from_torch(kv), DeviceTensor.from_torch(rows),
                           DeviceTensor.from_torch(context_lens), DeviceTensor.from_torch(tables),
                           DeviceTensor.from_torch(workspace), num_heads, num_kv_heads, head_dim, scale,
                           sliding_window, max_context)
    stream.sync()
    ours, reference = [], []
    for b, context in enumerate(contexts):
        row = int(rows[b])
        position = torch.tensor([context - 1], device=DEVICE)
        reference.append(reference_attention(q[row].view(1, num_heads, head_dim), sequences[b], position, scale,
                                             sliding_window))
        ours.append(out[row].view(1, num_heads, head_dim))
    assert_close(torch.cat(ours), torch.cat(reference))
    untouched = torch.ones(num_rows, dtype=torch.bool, device=DEVICE)
    untouched[rows.long()] = False
    assert out[untouched].isnan().all()


RANDOM_CONTEXTS = torch.randint(1, 5001, (59,), generator=torch.Generator().manual_seed(7)).tolist()
DECODE_BATCHES = {
    "1": [5000],
    "1-short": [1],
    "7-mixed": [1, 15, 16, 17, 1000, 4097, 5000],
    "64-mixed": [1, 16, 33, 4096, 5000] + RANDOM_CONTEXTS,
}


@pytest.mark.gpu
@pytest.mark.parametrize("batch", DECODE_BATCHES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (32, 8), (64, 8), (16, 1)], ids=["g1", "g4", "g8", "g16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sliding_window", [-1, 700])
def test_decode(kernel_library, stream, batch, num_heads, num_kv_heads, head_dim, sliding_window):
    run_decode(kernel_library, stream, DECODE_BATCHES[batch], num_heads, num_kv_heads, head_dim, 16, sliding_window)


# Grouped heads take the mma kernel; one query head per kv head (multi-head, M2M100) the warp-per-head kernel.
KERNELS = {"grouped": (12, 4), "mha": (6, 6)}


@pytest.mark.gpu
@pytest.mark.parametrize("heads", KERNELS)
@pytest.mark.parametrize("head_dim, block_size", [(32, 16), (64, 32), (128, 64)])
@pytest.mark.parametrize("sliding_window", [-1, 1, 100])
def test_decode_block_sizes_and_windows(kernel_library, stream, heads, head_dim, block_size, sliding_window):
    run_decode(kernel_library, stream, [1, 2, 31, 32, 33, 63, 64, 65, 300, 2049], *KERNELS[heads], head_dim,
               block_size, sliding_window)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", KERNELS)
@pytest.mark.parametrize("max_context", [8192, 65536])
def test_decode_captured_max_context(kernel_library, stream, heads, max_context):
    # A graph captured for max_context runs shorter contexts: splits past a context write nothing.
    run_decode(kernel_library, stream, [3, 900, 5000], *KERNELS[heads], 128, 16, -1, max_context=max_context)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", KERNELS)
def test_decode_peaked_scores(kernel_library, stream, heads):
    # Scores spread over +-100: the running max must rescale, never overflow.
    run_decode(kernel_library, stream, [1, 77, 3000], *KERNELS[heads], 128, 16, -1, sharpness=6.0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, block_size", [(32, 16), (64, 16), (128, 32)])
@pytest.mark.parametrize("rotation", ["identity", "none", "random"])
def test_decode_with_new_tokens_equals_rope_and_write_then_attention(kernel_library, stream, head_dim, block_size,
                                                                      rotation):
    """The multi-head kernel given the new tokens (it rotates and writes each, and attends it) against
    rope_and_write_kv then the plain kernel, on copies of one cache: the same outputs and the same cache after.
    Contexts of one key (the new one alone), across a 32-key chunk, and over several splits, with rows no sequence
    owns (slot -1: nothing written). M2M100's identity rotation gives identical bits, and so does no rotation
    (no tables: the fused kernel rotates nothing) against the identity's rope_and_write_kv."""
    from metrale.runtime.backend.cuda.kernels.attention import NewTokens
    from metrale.runtime.backend.cuda.kernels.rope_kv import rope_and_write_kv

    contexts, heads = [1, 2, 32, 33, 34, 65, 300, 5000], 6
    batch, num_rows = len(contexts), len(contexts) + 3
    kv, tables, _ = paged_cache(contexts, [0] * batch, block_size, heads, head_dim, DEVICE, poison=False,
                                table_tokens=max(contexts))
    rows = torch.randperm(num_rows)[:batch].to(torch.int32).to(DEVICE)
    qkv = torch.randn(num_rows, 3 * heads * head_dim, device=DEVICE).bfloat16()
    positions = torch.zeros(num_rows, dtype=torch.int32, device=DEVICE)
    slots = torch.full((num_rows,), -1, dtype=torch.int32, device=DEVICE)
    for b, context in enumerate(contexts):
        positions[rows[b]] = context - 1
        slots[rows[b]] = tables[b, (context - 1) // block_size] * block_size + (context - 1) % block_size
    if rotation in ("identity", "none"):
        cos, sin = torch.ones(5000, head_dim // 2, device=DEVICE), torch.zeros(5000, head_dim // 2, device=DEVICE)
    else:
        angles = torch.rand(5000, head_dim // 2, device=DEVICE) * 6.3
        cos, sin = angles.cos(), angles.sin()
    width, scale = heads * head_dim, head_dim ** -0.5
    elements = decode_workspace_elements(kernel_library, batch, heads, heads, head_dim, max(contexts))
    view = DeviceTensor.from_torch
    results = []
    for fused in (False, True):
        cache, buffer = kv.clone(), qkv.clone()
        out = torch.full((num_rows, width), NAN, dtype=torch.bfloat16, device=DEVICE)
        workspace = torch.full((max(elements, 4),), NAN, dtype=torch.float32, device=DEVICE)
        torch.cuda.synchronize()
        new_tokens = None
        if fused:
            tables_of = (None, None) if rotation == "none" else (view(cos), view(sin))
            new_tokens = NewTokens(view(buffer[:, width:2 * width]), view(buffer[:, 2 * width:]), *tables_of,
                                   view(positions), view(slots))
        else:
            rope_and_write_kv(kernel_library, stream, view(buffer), view(cos), view(sin), view(positions), view(slots),
                              view(cache), heads, heads, head_dim)
        paged_decode_attention(kernel_library, stream, view(out), view(buffer[:, :width]), view(cache), view(rows),
                               view(torch.tensor(contexts, dtype=torch.int32, device=DEVICE)), view(tables),
                               view(workspace), heads, heads, head_dim, scale, -1, max(contexts),
                               new_tokens=new_tokens)
        stream.sync()
        results.append((out, cache))
    (out_a, cache_a), (out_b, cache_b) = results
    owned = torch.zeros(num_rows, dtype=torch.bool, device=DEVICE)
    owned[rows.long()] = True
    assert out_b[~owned].isnan().all() and not out_b[owned].isnan().any()
    if rotation != "random":
        assert torch.equal(out_a[owned], out_b[owned]) and torch.equal(cache_a, cache_b)
    else:   # the rotation's products may be contracted differently: within bf16 rounding
        assert relative_error(out_b[owned], out_a[owned]) < 1e-3
        assert relative_error(cache_b, cache_a) < 1e-3


def run_prefill(lib, stream, segments, num_heads, num_kv_heads, head_dim, block_size, sliding_window, sharpness=1.0,
                causal=True, hopper=None, tma=True):
    """segments: (query_len, context_len) each; segments sit in T in order with one unowned row between them.
    causal=False: every query sees all of its segment's context (then query_len may pass context_len).
    hopper, tma: as paged_prefill_attention takes them (hopper=False: the mma.sync kernel on any device)."""
    query_lens = [n for n, _ in segments]
    contexts = [c for _, c in segments]
    first_read = [window_start(c - n, sliding_window) if causal else 0 for n, c in segments]
    kv, tables, sequences = paged_cache(contexts, first_read, block_size, num_kv_heads, head_dim, DEVICE)
    starts, row = [], 1
    for n in query_lens:
        starts.append(row)
        row += n + 1
    num_rows = row
    q = query_buffer(num_rows, num_heads, num_kv_heads, head_dim, sharpness, DEVICE)
    out = torch.full((num_rows, num_heads * head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
    # held in names until the kernel has run: a DeviceTensor does not keep its torch tensor alive
    starts_device, lens_device, contexts_device = (torch.tensor(xs, dtype=torch.int32, device=DEVICE)
                                                   for xs in (starts, query_lens, contexts))
    scale = head_dim ** -0.5
    torch.cuda.synchronize()
    paged_prefill_attention(lib, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(q),
                            DeviceTensor.from_torch(kv), DeviceTensor.from_torch(starts_device),
                            DeviceTensor.from_torch(lens_device), DeviceTensor.from_torch(contexts_device),
                            DeviceTensor.from_torch(tables), num_heads, num_kv_heads, head_dim, scale, sliding_window,
                            len(segments), max(query_lens), causal, hopper=hopper, tma=tma)
    stream.sync()
    ours, reference = [], []
    untouched = torch.ones(num_rows, dtype=torch.bool, device=DEVICE)
    for s, (n, context) in enumerate(segments):
        rows = slice(starts[s], starts[s] + n)
        positions = (torch.arange(context - n, context, device=DEVICE) if causal
                     else torch.full((n,), context - 1, device=DEVICE))
        reference.append(reference_attention(q[rows].view(n, num_heads, head_dim), sequences[s], positions, scale,
                                             sliding_window))
        ours.append(out[rows].view(n, num_heads, head_dim))
        untouched[rows] = False
    assert_close(torch.cat(ours), torch.cat(reference))
    assert out[untouched].isnan().all()


PREFILL_SEGMENTS = {
    "1": [(1, 1)],
    "37": [(37, 37)],
    "64": [(64, 64)],
    "65": [(65, 65)],
    "700": [(700, 700)],
    "chunked": [(100, 612)],
    "chunked-aligned": [(64, 1000)],
    "chunked-one": [(1, 300)],
    "mixed": [(700, 700), (1, 50), (129, 400), (64, 64), (5, 1000), (33, 33)],
    "long": [(2500, 2500), (1000, 3100)],
    # contexts ending on a 128-key tile's edge (the Hopper kernel's tiles all whole, none gathered) and just past it
    "tile-edges": [(256, 256), (128, 384), (129, 257)],
    # segments with no new rows (a sequence with nothing to prefill this step) beside ones with some
    "empty-beside": [(0, 40), (70, 300), (0, 1), (5, 5)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("segments", PREFILL_SEGMENTS, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (16, 4), (32, 4)], ids=["g1", "g4", "g8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sliding_window", [-1, 100])
@pytest.mark.parametrize("kernel", ["default", "cp.async", "mma.sync"])
def test_prefill(kernel_library, stream, segments, num_heads, num_kv_heads, head_dim, sliding_window, kernel):
    # default: the Hopper kernel on an H100/H200 (whole tiles through the tensor map); cp.async: it gathering every
    # tile; mma.sync: the kernel of other architectures, on every device
    run_prefill(kernel_library, stream, PREFILL_SEGMENTS[segments], num_heads, num_kv_heads, head_dim, 16,
                sliding_window, hopper=False if kernel == "mma.sync" else None, tma=kernel != "cp.async")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, block_size", [(32, 16), (64, 32), (128, 64)])
@pytest.mark.parametrize("sliding_window", [-1, 1, 64, 128, 257])   # 128: a window the size of a Hopper tile
def test_prefill_block_sizes_and_windows(kernel_library, stream, head_dim, block_size, sliding_window):
    run_prefill(kernel_library, stream, [(300, 300), (17, 500), (128, 193)], 8, 2, head_dim, block_size,
                sliding_window)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_not_causal(kernel_library, stream, head_dim):
    # An encoder's self-attention and a decoder's cross-attention over its source: rows see the whole context,
    # and a segment may have more rows than keys (a decoder prompt over a short source).
    run_prefill(kernel_library, stream, [(1, 37), (5, 3), (70, 200), (64, 64), (130, 129)], 16, 16, head_dim, 16, -1,
                causal=False)


@pytest.mark.gpu
def test_prefill_peaked_scores(kernel_library, stream):
    run_prefill(kernel_library, stream, [(200, 200), (70, 1100)], 16, 2, 128, 16, -1, sharpness=6.0)


@pytest.mark.parametrize("sliding_window", [-1, 5])
def test_reference_matches_cpu_backend(sliding_window):
    # The float64 reference above computes what CpuLayerMath.paged_attention computes (no GPU needed).
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 16, 4
    segments = [(1, 9), (6, 6), (3, 11), (1, 1)]
    contexts = [c for _, c in segments]
    kv, tables, sequences = paged_cache(contexts, [0] * len(segments), block_size, num_kv_heads, head_dim, "cpu",
                                        poison=False)
    kv = kv.float()
    starts = [0, 1, 7, 10]
    q = torch.randn(11, num_heads * head_dim)
    batch = ForwardBatch(torch.zeros(11, dtype=torch.int64), torch.zeros(11, dtype=torch.int64),
                         torch.zeros(11, dtype=torch.int64), starts, [n for n, _ in segments], contexts,
                         [tables[s, :math.ceil(c / block_size)].tolist() for s, c in enumerate(contexts)],
                         torch.zeros(0, dtype=torch.int64))
    cpu_math = CpuLayerMath("float32")
    window = None if sliding_window < 0 else sliding_window
    cpu = cpu_math.paged_attention(q, kv, cpu_math.prepare(batch), num_kv_heads, head_dim, 0.3, window)
    for s, (n, context) in enumerate(segments):
        rows = slice(starts[s], starts[s] + n)
        ours = reference_attention(q[rows].view(n, num_heads, head_dim), sequences[s].float(),
                                   torch.arange(context - n, context), 0.3, sliding_window)
        assert relative_error(cpu[rows].view(n, num_heads, head_dim), ours) < TOLERANCE[torch.float32]
