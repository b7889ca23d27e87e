"""The device: cuda.core Device and its setup stream, every driver call checked, host<->device copies on a given
stream, and the arenas the memory plan carves its allocations with."""

import ctypes
import math
import threading

import numpy as np
from cuda.bindings import driver
from cuda.core import Device

# cuda.core's error for a failed driver call of its own (it exports no public name for it): a device fault.
from cuda.core._utils.cuda_utils import CUDAError  # noqa: F401 (the backend's device_errors)

from metrale.runtime.backend.cuda.tensor import DTYPES, DeviceTensor
from metrale.runtime.errors import DeviceFault, FailedPrecondition

ALIGNMENT = 256


def check(result) -> object:
    """cuda.bindings calls return (status, *values); raise with the status name, return the values."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise DeviceFault(f"CUDA driver error {status.name}")
    return values[0] if len(values) == 1 else values


def device_count() -> int:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES's)."""
    check(driver.cuInit(0))
    return int(check(driver.cuDeviceGetCount()))


def arch_of(device: Device) -> str:
    """NVRTC target: 'sm_90a' on Hopper (wgmma, setmaxnreg), 'sm_XY' elsewhere."""
    return "sm_90a" if device.arch == "90" else f"sm_{device.arch}"


class CudaDevice:
    def __init__(self, index: int = 0):
        try:
            self.device = Device(index)
            self.device.set_current()
        except Exception as error:
            raise FailedPrecondition(f"no usable CUDA device {index}: {error}") from None
        self.arch = arch_of(self.device)
        # Allocations and weight uploads at start; forwards run on their streams (stream_context.py).
        self.stream = self.device.create_stream()
        self._buffers = []
        self._current = threading.local()
        self._current.done = True

    def ensure_current(self) -> None:
        """Makes the device's context current on this thread (once per thread): streams run steps on threads
        of their own, and the driver needs a current context to create events and copy."""
        if not getattr(self._current, "done", False):
            self.device.set_current()
            self._current.done = True

    def free_memory(self) -> int:
        free, _ = check(driver.cuMemGetInfo())
        return int(free)

    def allocate(self, nbytes: int):
        """A device allocation that lives as long as this device object: the memory plan's arenas."""
        buffer = self.device.allocate(max(nbytes, ALIGNMENT), stream=self.stream)
        self.stream.sync()
        self._buffers.append(buffer)
        return int(buffer.handle)

    def copy_to_device(self, dst: DeviceTensor, host: np.ndarray, stream) -> None:
        """Asynchronous on `stream` (a cuda.core Stream); `host` must stay alive until the stream is synchronized."""
        if host.nbytes != dst.nbytes or not dst.is_contiguous:
            raise ValueError(f"copy of {host.nbytes} bytes into a {dst.shape} {dst.dtype} tensor")
        check(driver.cuMemcpyHtoDAsync(dst.ptr, host.ctypes.data, host.nbytes, int(stream.handle)))

    def pinned(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A page-locked host array, which kernels may write directly (at its device_address) for the host to read
        later; it lives as long as the process."""
        nbytes = max(1, math.prod(shape)) * DTYPES[dtype][0]
        pointer = int(check(driver.cuMemAllocHost(nbytes)))
        buffer = (ctypes.c_char * nbytes).from_address(pointer)
        return np.frombuffer(buffer, dtype=DTYPES[dtype][1], count=math.prod(shape)).reshape(shape)

    def device_address(self, host: np.ndarray) -> int:
        """Where a kernel reads and writes a pinned() array: its own address under unified addressing."""
        return int(check(driver.cuMemHostGetDevicePointer(host.ctypes.data, 0)))

    def copy_columns(self, dst: DeviceTensor, src: DeviceTensor, stream) -> None:
        """dst = src on the device, queued on `stream` (capturable): 2-D tensors of one shape and dtype, either
        strided (a column slice of a wider one)."""
        if dst.shape != src.shape or dst.dtype != src.dtype or len(dst.shape) != 2:
            raise ValueError(f"copy of a {src.shape} {src.dtype} tensor into a {dst.shape} {dst.dtype} one")
        copy = driver.CUDA_MEMCPY2D()
        copy.srcMemoryType = copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice, copy.srcPitch = src.ptr, src.stride * src.itemsize
        copy.dstDevice, copy.dstPitch = dst.ptr, dst.stride * dst.itemsize
        copy.WidthInBytes, copy.Height = dst.shape[1] * dst.itemsize, dst.shape[0]
        check(driver.cuMemcpy2DAsync(copy, int(stream.handle)))

    def copy_to_host(self, src: DeviceTensor, stream) -> np.ndarray:
        """Synchronous: queued on `stream` after its work, then waits for the stream."""
        host = np.empty(src.shape, dtype=DTYPES[src.dtype][1])
        handle = int(stream.handle)
        if src.is_contiguous:
            check(driver.cuMemcpyDtoHAsync(host.ctypes.data, src.ptr, host.nbytes, handle))
        else:
            row_bytes = src.shape[-1] * src.itemsize
            for row in range(src.shape[0]):
                check(driver.cuMemcpyDtoHAsync(host.ctypes.data + row * row_bytes,
                                               src.ptr + row * src.stride * src.itemsize, row_bytes, handle))
        stream.sync()
        return host


class Arena:
    """A bump allocator over one region: the weights, each stream's buffers and the KV pool, placed once at start."""

    def __init__(self, base: int, nbytes: int, name: str):
        self.base, self.nbytes, self.name = base, nbytes, name
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        size = math.prod(shape) * DTYPES[dtype][0]
        start = -(-self.used // ALIGNMENT) * ALIGNMENT
        if start + size > self.nbytes:
            raise FailedPrecondition(f"the {self.name} region ({self.nbytes} bytes) is too small: "
                                     f"{start + size} needed")
        self.used = start + size
        return DeviceTensor(self.base + start, tuple(shape), dtype)


class GrowingArena(Arena):
    """An Arena whose memory is committed as it is taken: `nbytes` of address space reserved at once (CUDA's virtual
    memory management), physical memory mapped behind it STEP bytes at a time as take() reaches past what is mapped.
    The weights' plan is an upper bound (every tensor as bf16); FP8 weights take half of it, and the memory they leave
    is never committed, so the KV pool sized after the upload gets it."""

    STEP = 64 << 20

    def __init__(self, device: "CudaDevice", nbytes: int, name: str):
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.device.device_id
        granularity = int(check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
        self.step = -(-self.STEP // granularity) * granularity
        reserved = -(-max(nbytes, 1) // self.step) * self.step
        super().__init__(int(check(driver.cuMemAddressReserve(reserved, 0, 0, 0))), nbytes, name)
        self._prop, self.mapped = prop, 0
        self._access = driver.CUmemAccessDesc()
        self._access.location = prop.location
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._handles = []          # kept for as long as the process: the weights live that long

    def take(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        tensor = super().take(shape, dtype)
        while self.mapped < self.used:
            handle = check(driver.cuMemCreate(self.step, self._prop, 0))
            self._handles.append(handle)
            check(driver.cuMemMap(self.base + self.mapped, self.step, 0, handle, 0))
            check(driver.cuMemSetAccess(self.base + self.mapped, self.step, [self._access], 1))
            self.mapped += self.step
        return tensor


class RingArena(Arena):
    """The activation workspace. Reset at the start of every forward, so a forward's tensors get the same
    addresses every time (CUDA graphs replay them). Allocation wraps around: a tensor must be dead once
    `nbytes` more bytes have been taken after it; the workspace is sized at three layers' worth, and a
    layer's tensors die within the next layer."""

    def take(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        size = -(-math.prod(shape) * DTYPES[dtype][0] // ALIGNMENT) * ALIGNMENT
        if size > self.nbytes:
            raise FailedPrecondition(f"a {shape} {dtype} tensor does not fit the activation workspace "
                                     f"({self.nbytes} bytes); lower max_batch_tokens")
        if self.used + size > self.nbytes:
            self.used = 0
        tensor = DeviceTensor(self.base + self.used, tuple(shape), dtype)
        self.used += size
        return tensor

    def reset(self) -> None:
        self.used = 0
