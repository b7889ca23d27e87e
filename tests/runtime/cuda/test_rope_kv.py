"""rope_kv.cu against a float64 torch reference: q and k rotated in qkv, k and v written to their paged KV slots;
the write alone, and copies of block prefixes (exact: they only move bytes)."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.kernels.rope_kv import copy_kv_prefixes, rope_and_write_kv, write_kv  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
MAX_POSITIONS = 4096


def rope_tables(head_dim: int, base: float = 10000.0):
    """cos, sin [MAX_POSITIONS, head_dim / 2] float32, as models/rope.py builds them."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=DEVICE) / head_dim)
    angles = torch.arange(MAX_POSITIONS, dtype=torch.float64, device=DEVICE)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def reference_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] bf16, cos/sin [T, head_dim / 2] fp32 -> float64, rotate-half."""
    x1, x2 = x.double().chunk(2, dim=-1)
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# (heads, kv heads, head_dim, block_size, num_blocks): the tiny test model, Llama-3-8B, MHA at 64, MQA at 256.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, num_blocks",
                         [(4, 2, 16, 16, 8), (32, 8, 128, 16, 40), (16, 16, 64, 32, 12), (8, 1, 256, 16, 24)])
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_rope_and_write_kv(kernel_library, stream, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                           num_tokens):
    num_slots = num_blocks * block_size
    if num_tokens >= num_slots:
        num_blocks = num_tokens // block_size + 2
        num_slots = num_blocks * block_size
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE).bfloat16()
    original = qkv.clone()
    cos, sin = rope_tables(head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), device=DEVICE, dtype=torch.int32)
    positions[0] = MAX_POSITIONS - 1
    slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens].int()
    if num_tokens > 1:
        slots[1] = -1   # a padding token: rotated, written nowhere
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16,
                    device=DEVICE)
    torch.cuda.synchronize()
    rope_and_write_kv(kernel_library, stream, DeviceTensor.from_torch(qkv), DeviceTensor.from_torch(cos),
                      DeviceTensor.from_torch(sin), DeviceTensor.from_torch(positions),
                      DeviceTensor.from_torch(slots), DeviceTensor.from_torch(kv), num_heads, num_kv_heads, head_dim)
    stream.sync()

    at = positions.long()
    q = original[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = original[:, q_size:q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    v = original[:, q_size + kv_size:].reshape(num_tokens, num_kv_heads, head_dim)
    q_reference, k_reference = reference_rotate(q, cos[at], sin[at]), reference_rotate(k, cos[at], sin[at])
    rotated = qkv.view(num_tokens, -1, head_dim)
    assert relative_error(rotated[:, :num_heads], q_reference) < TOLERANCE[torch.bfloat16]
    assert relative_error(rotated[:, num_heads:num_heads + num_kv_heads], k_reference) < TOLERANCE[torch.bfloat16]
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:])

    # kv[p, slot // block_size, slot % block_size] is kv.view(2, num_slots, ...)[p, slot].
    flat = kv.view(2, num_slots, num_kv_heads, head_dim)
    written = slots >= 0
    written_slots = slots[written].long()
    assert relative_error(flat[0, written_slots], k_reference[written]) < TOLERANCE[torch.bfloat16]
    assert torch.equal(flat[0, written_slots], rotated[written, num_heads:num_heads + num_kv_heads])
    assert torch.equal(flat[1, written_slots], v[written])
    for token in torch.nonzero(written).flatten().tolist():
        slot = int(slots[token])
        block, offset = divmod(slot, block_size)
        assert torch.equal(kv[0, block, offset], rotated[token, num_heads:num_heads + num_kv_heads])
        assert torch.equal(kv[1, block, offset], v[token])
    unwritten = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    unwritten[written_slots] = False
    assert flat[:, unwritten].isnan().all()


def test_write_kv_puts_each_row_in_its_slot(kernel_library, stream):
    num_blocks, block_size, kv_heads, head_dim, tokens = 9, 16, 4, 64, 37
    kv = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    kv_wide = torch.randn(tokens, 3 * kv_heads * head_dim, device=DEVICE).bfloat16()    # [q | k | v] columns
    k, v = kv_wide[:, kv_heads * head_dim:2 * kv_heads * head_dim], kv_wide[:, 2 * kv_heads * head_dim:]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].int()
    slots[5] = -1                                     # a padding token: writes nothing
    torch.cuda.synchronize()
    write_kv(kernel_library, stream, *(DeviceTensor.from_torch(t) for t in (k, v, slots, kv)))
    stream.sync()
    flat = kv.view(2, -1, kv_heads, head_dim)
    written = slots >= 0
    assert torch.equal(flat[0, slots[written].long()], k[written].view(-1, kv_heads, head_dim))
    assert torch.equal(flat[1, slots[written].long()], v[written].view(-1, kv_heads, head_dim))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots[written].long()] = False
    assert flat[:, untouched].isnan().all()


@pytest.mark.parametrize("layer", [(2, 12, 16, 2, 64), (12, 16, 576)], ids=["kv", "latent"])
def test_copy_kv_prefixes_in_every_layer(kernel_library, stream, layer):
    """K/V layers [2, blocks, block_size, kv_heads, head_dim], or multi-head latent attention's [blocks,
    block_size, width]: the first n slots of each copy's source block into its destination, in every layer."""
    layers, block_axis = 3, 1 + (len(layer) == 5)
    pool = torch.randn(layers, *layer, device=DEVICE).bfloat16()
    before = pool.clone()
    copies = torch.tensor([[1, 7, 5], [2, 8, 16], [1, 9, 1]], dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    copy_kv_prefixes(kernel_library, stream, [DeviceTensor.from_torch(pool[i]) for i in range(layers)],
                     DeviceTensor.from_torch(copies), 3)
    stream.sync()
    expected = before.clone()
    for src, dst, n in copies.tolist():
        expected.select(block_axis, dst).narrow(block_axis, 0, n).copy_(
            before.select(block_axis, src).narrow(block_axis, 0, n))
    assert torch.equal(pool, expected)
