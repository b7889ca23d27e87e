"""Stand-ins for kernel tests and benchmarks that run the CUDA kernels outside an engine."""

from types import SimpleNamespace

import numpy as np


class BareStreamContext:
    """What CudaDeviceSearch lays its state out with, without a memory plan or graphs: the kernels, a table width,
    and copies on one stream (host arrays kept alive until the stream is)."""

    def __init__(self, lib, stream, max_blocks_per_seq: int = 4):
        self.lib, self.stream, self.graphs = lib, stream, None
        self.shapes = SimpleNamespace(max_blocks_per_seq=max_blocks_per_seq)
        self._kept = []

    def copy_to_device(self, dst, host: np.ndarray) -> None:
        from cuda.bindings import driver
        self._kept.append(host)
        driver.cuMemcpyHtoDAsync(dst.ptr, host.ctypes.data, host.nbytes, int(self.stream.handle))

    def copy_to_host(self, src) -> np.ndarray:
        from cuda.bindings import driver
        host = np.empty(src.shape, dtype=np.float32 if src.dtype == "float32" else np.int32)
        driver.cuMemcpyDtoHAsync(host.ctypes.data, src.ptr, host.nbytes, int(self.stream.handle))
        self.stream.sync()
        return host
