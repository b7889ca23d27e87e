"""embedding.cu against torch: token embedding lookup and row gathers (bf16 and fp32, strided, unaligned)."""

import pytest
import torch

pytest.importorskip("cuda.core")

from gpu_reference import TOLERANCE, relative_error  # noqa: E402
from metrale.runtime.backend.cuda.kernels.embedding import embedding, gather_rows  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# (vocab, hidden, tokens); hidden 36 rows are 72 bytes: the 2-byte fallback.
@pytest.mark.parametrize("vocab, hidden, num_tokens", [(256, 64, 1), (1000, 72, 7), (32000, 4096, 300),
                                                       (151936, 1024, 33), (100, 36, 5)])
def test_embedding_matches_table_rows(kernel_library, stream, vocab, hidden, num_tokens):
    table = torch.randn(vocab, hidden, device=DEVICE).bfloat16()
    token_ids = torch.randint(0, vocab, (num_tokens,), device=DEVICE, dtype=torch.int32)
    token_ids[0] = vocab - 1
    out = poisoned(num_tokens, hidden, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    embedding(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(table),
              DeviceTensor.from_torch(token_ids))
    stream.sync()
    reference = table.double()[token_ids.long()]
    assert relative_error(out, reference) < TOLERANCE[torch.bfloat16]
    assert torch.equal(out, table[token_ids.long()])


def test_embedding_out_of_range_id_gives_zero_row(kernel_library, stream):
    table = torch.randn(50, 64, device=DEVICE).bfloat16()
    token_ids = torch.tensor([3, 50, -1, 49], device=DEVICE, dtype=torch.int32)
    out = poisoned(4, 64, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    embedding(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(table),
              DeviceTensor.from_torch(token_ids))
    stream.sync()
    assert torch.equal(out[[0, 3]], table[[3, 49]])
    assert torch.equal(out[[1, 2]], torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE))


# (dtype, rows of x, columns, gathered rows, column offset into x's buffer, buffer width): these pick the 16-byte
# copy (contiguous; a bf16 slice at offset 8 of an 80-wide buffer), the 4-byte one (an fp32 vocab of 50257; an fp32
# slice at offset 1) and the 2-byte one (a bf16 slice at offset 3).
@pytest.mark.parametrize("dtype, num_x_rows, columns, num_rows, offset, width", [
    (torch.bfloat16, 300, 4096, 7, 0, 4096), (torch.bfloat16, 9, 64, 1, 8, 80),
    (torch.bfloat16, 17, 4095, 5, 3, 4100), (torch.float32, 33, 151936, 3, 0, 151936),
    (torch.float32, 5, 50257, 4, 0, 50257), (torch.float32, 8, 96, 8, 1, 100)])
def test_gather_rows_matches_indexing(kernel_library, stream, dtype, num_x_rows, columns, num_rows, offset, width):
    x = torch.randn(num_x_rows, width, device=DEVICE).to(dtype)[:, offset:offset + columns]
    rows = torch.randint(0, num_x_rows, (num_rows,), device=DEVICE, dtype=torch.int32)
    rows[-1] = num_x_rows - 1
    out_wide = poisoned(num_rows, columns + 8, dtype=dtype)
    out = out_wide[:, :columns]
    torch.cuda.synchronize()
    gather_rows(kernel_library, stream, DeviceTensor.from_torch(out), DeviceTensor.from_torch(x),
                DeviceTensor.from_torch(rows))
    stream.sync()
    reference = x.double()[rows.long()]
    assert relative_error(out, reference) < TOLERANCE[dtype]
    assert torch.equal(out, x[rows.long()])
    assert out_wide[:, columns:].isnan().all()
