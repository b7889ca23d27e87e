"""The weights' arena commits device memory only as far as its tensors reach (CUDA virtual memory), and what it
commits reads and writes like any allocation."""

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.device import CudaDevice, GrowingArena  # noqa: E402

pytestmark = pytest.mark.gpu


def test_memory_is_committed_as_tensors_are_taken(cuda_device):
    cuda = CudaDevice()
    free = cuda.free_memory()
    arena = GrowingArena(cuda, 8 << 30, "weights")                  # 8 GiB of address space, none of it memory
    assert arena.mapped == 0 and free - cuda.free_memory() < arena.step
    first = arena.take((1000, 1000), "float32")                     # 4 MB: one step committed
    assert arena.mapped == arena.step
    second = arena.take((arena.step // 2,), "bfloat16")             # past the first step: a second
    assert arena.mapped == 2 * arena.step and second.ptr > first.ptr
    assert free - cuda.free_memory() < 3 * arena.step
    for tensor, dtype in ((first, np.float32), (second, np.uint16)):
        values = np.arange(tensor.numel, dtype=dtype).reshape(tensor.shape)
        cuda.copy_to_device(tensor, values, cuda.stream)
        assert np.array_equal(cuda.copy_to_host(tensor, cuda.stream), values)
