"""Device tensors: a raw pointer, a shape, a dtype and a row stride. No allocation, no copies."""

from dataclasses import dataclass

import math
import numpy as np

from metrale.runtime.errors import InvalidArgument

# name -> (bytes per element, numpy dtype for host copies; bf16 travels as uint16, e4m3 as uint8)
DTYPES = {"bfloat16": (2, np.uint16), "float16": (2, np.float16), "float32": (4, np.float32),
          "int32": (4, np.int32), "int64": (8, np.int64), "uint8": (1, np.uint8), "float8_e4m3": (1, np.uint8)}


@dataclass(slots=True, unsafe_hash=True)
class DeviceTensor:
    """Row-major; a 2-D tensor may be a column slice of a wider one (row_stride > shape[1]). Never changed once made
    (not frozen only because a frozen dataclass takes 3x as long to make, and a forward makes hundreds)."""
    ptr: int
    shape: tuple[int, ...]
    dtype: str
    # Elements between the starts of two rows of a 2-D tensor; None = contiguous.
    row_stride: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} is not a device dtype: {sorted(DTYPES)}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def stride(self) -> int:
        """Elements between rows (the last dimension is always dense)."""
        return self.row_stride if self.row_stride is not None else self.shape[-1]

    @property
    def is_contiguous(self) -> bool:
        return self.row_stride is None or self.row_stride == self.shape[-1]

    def view(self, *shape: int) -> "DeviceTensor":
        if not self.is_contiguous:
            raise InvalidArgument("view of a strided tensor")
        if math.prod(shape) != self.numel:
            raise InvalidArgument(f"cannot view {self.shape} as {shape}")
        return DeviceTensor(self.ptr, tuple(shape), self.dtype)

    def rows(self, start: int, stop: int) -> "DeviceTensor":
        """Rows [start, stop) of a 2-D (or wider) tensor; elements [start, stop) of a 1-D one."""
        step = self.stride if len(self.shape) > 1 else 1
        return DeviceTensor(self.ptr + start * step * self.itemsize, (stop - start, *self.shape[1:]),
                            self.dtype, self.row_stride)

    def columns(self, start: int, stop: int) -> "DeviceTensor":
        """Columns [start, stop) of a 2-D tensor: a strided view."""
        if len(self.shape) != 2 or not 0 <= start <= stop <= self.shape[1]:
            raise InvalidArgument(f"columns [{start}, {stop}) of a tensor of shape {self.shape}")
        return DeviceTensor(self.ptr + start * self.itemsize, (self.shape[0], stop - start), self.dtype, self.stride)

    def __getitem__(self, index):
        """x[:, a:b] (columns) and x[a:b] (rows), as the model code slices."""
        if isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None):
            cols = index[1]
            return self.columns(cols.start or 0, self.shape[1] if cols.stop is None else cols.stop)
        if isinstance(index, slice) and index.step in (None, 1):
            return self.rows(index.start or 0, self.shape[0] if index.stop is None else index.stop)
        raise InvalidArgument(f"unsupported device tensor index {index!r}")

    @classmethod
    def from_torch(cls, tensor) -> "DeviceTensor":
        """A view of a CUDA torch tensor (tests and references only; the hot path never holds torch tensors)."""
        name = str(tensor.dtype).removeprefix("torch.")
        name = "float8_e4m3" if name == "float8_e4m3fn" else name
        if tensor.dim() == 2 and tensor.stride(1) == 1 and tensor.stride(0) != tensor.shape[1]:
            return cls(tensor.data_ptr(), tuple(tensor.shape), name, tensor.stride(0))
        if not tensor.is_contiguous():
            raise InvalidArgument("from_torch needs a contiguous tensor or a 2-D column slice")
        return cls(tensor.data_ptr(), tuple(tensor.shape), name)


@dataclass(slots=True, unsafe_hash=True)
class Fp8KvTensor(DeviceTensor):
    """An FP8 KV cache layer (cache/specs.py's PagedKvFp8): e4m3 values [2, blocks, block_size, kv_heads, head_dim]
    with their heads' scales, `scales` [2, kv_heads] float32 (K's, then V's) on the device. A DeviceTensor, so the
    code that copies or pools paged layers takes it as one; the attention kernels read the scales beside it."""
    scales: DeviceTensor | None = None
