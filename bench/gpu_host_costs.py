"""What the host pays for the driver calls a forward makes, on this machine: an async host-to-device copy of a
forward's metadata from pageable memory and from page-locked memory, an event record, and a wait on an event that
has completed. Each is the median host time of many calls on an idle stream and on a stream kept busy by a
running kernel (the copies of a forward are queued behind the one before).

python3 -m bench.gpu_host_costs        (on the GPU machine)
"""

import statistics
import time

import numpy as np
from cuda.bindings import driver

from bench.gpu_ceilings import gpu_machine_line
from metrale.runtime.backend.cuda.device import CudaDevice, check
from metrale.runtime.backend.cuda.tensor import DeviceTensor

SIZES = (4480, 10432, 65536)
CALLS = 300


def host_us(call, calls: int = CALLS, after=None) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
        if after:
            after()
    return statistics.median(times) * 1e6


def main() -> None:
    print(gpu_machine_line("gpu_host_costs", "cuda"))
    cuda = CudaDevice()
    stream = cuda.device.create_stream()
    handle = int(stream.handle)
    target = DeviceTensor(cuda.allocate(1 << 20), (1 << 18,), "int32")
    print(f"{'what':<44} {'idle stream us':>14} {'synced each us':>14}")
    for size in SIZES:
        pageable = np.arange(size // 4, dtype=np.int32)
        pinned = cuda.pinned((size // 4,), "int32")
        pinned[:] = pageable
        for name, host in (("pageable", pageable), ("pinned", pinned)):
            def copy(host=host):
                check(driver.cuMemcpyHtoDAsync(target.ptr, host.ctypes.data, host.nbytes, handle))
            queued = host_us(copy)
            stream.sync()
            synced = host_us(copy, after=stream.sync)
            print(f"{f'HtoD async {size} B from {name}':<44} {queued:14.1f} {synced:14.1f}")
    staged = np.arange(SIZES[1] // 4, dtype=np.int32)
    pinned = cuda.pinned(staged.shape, "int32")

    def stage_and_copy():
        np.copyto(pinned, staged)
        check(driver.cuMemcpyHtoDAsync(target.ptr, pinned.ctypes.data, pinned.nbytes, handle))
    print(f"{'np.copyto into pinned, then HtoD, 10432 B':<44} {host_us(stage_and_copy):14.1f} "
          f"{host_us(stage_and_copy, after=stream.sync):14.1f}")
    print(f"{'stream.record()':<44} {host_us(stream.record):14.1f}")
    event = stream.record()
    stream.sync()
    print(f"{'event.sync() on a completed event':<44} {host_us(event.sync):14.1f}")
    print(f"{'stream.sync() on an idle stream':<44} {host_us(stream.sync):14.1f}")


if __name__ == "__main__":
    main()
