"""A kernel library whose one module is built from another source file: a benchmark times a kernel change's
before and after in one call of the lent GPU (`--variant NAME=FILE`), the other modules from the package."""

from pathlib import Path


class KernelVariant:
    """lib's kernels, except `module`'s, which come from `source` (its .cuh includes inlined from the package's)."""

    def __init__(self, lib, module: str, source: str):
        from cuda.core import ObjectCode

        from metrale.runtime.backend.cuda.compiler import compile_cubin, with_headers
        self._lib, self._module, self.arch = lib, module, lib.arch
        self._code = ObjectCode.from_cubin(compile_cubin(module, with_headers(source), lib.arch))
        self._kernels = {}

    def get(self, kernel_name: str, module: str):
        if module != self._module:
            return self._lib.get(kernel_name, module)
        if kernel_name not in self._kernels:
            self._kernels[kernel_name] = self._code.get_kernel(kernel_name)
        return self._kernels[kernel_name]

    def get_with_shared(self, kernel_name: str, module: str, shared_bytes: int):
        if module != self._module:
            return self._lib.get_with_shared(kernel_name, module, shared_bytes)
        from metrale.runtime.backend.cuda.compiler import allow_dynamic_shared
        kernel = self.get(kernel_name, module)
        allow_dynamic_shared(kernel, shared_bytes)
        return kernel

    def max_block(self, kernel_name: str, module: str) -> int:
        """As KernelLibrary.max_block, from this build's registers for the variant's module."""
        if module != self._module:
            return self._lib.max_block(kernel_name, module)
        return self.get(kernel_name, module).attributes.max_threads_per_block // 32 * 32

    def __getattr__(self, name):            # the rest (occupancy) as the package's
        return getattr(self._lib, name)


def variant_libraries(lib, module: str, specs: list[str]) -> dict:
    """{"package": lib, NAME: KernelVariant, ...} from NAME=FILE specs."""
    libraries = {"package": lib}
    for spec in specs:
        name, path = spec.split("=", 1)
        libraries[name] = KernelVariant(lib, module, Path(path).read_text())
    return libraries


def add_variant_option(parser, source: str) -> None:
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help=f"a {source} to time beside the package's (repeatable)")


def bench_libraries(module: str, specs: list[str]):
    """(device 0 as a CudaDevice, {"package": its kernel library, NAME: the NAME=FILE variants of `module`})."""
    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import CudaDevice

    device = CudaDevice(0)
    lib = KernelLibrary(device.arch, KernelCache(Path("/tmp/metrale-bench-kernels")))
    return device, variant_libraries(lib, module, specs)


def time_launch_us(stream, launch, copies: int) -> float:
    """Microseconds a launch: `copies` of it captured in one graph (gemm_tuning.time_per_launch), torch's work on the
    device finished first."""
    import torch

    from metrale.runtime.backend.cuda.gemm_tuning import time_per_launch
    torch.cuda.synchronize()
    return time_per_launch(stream, [launch] * copies) * 1e6


def relative_diff(got, reference) -> float:
    """A variant's output against the package's: the largest difference over the largest magnitude."""
    return ((got - reference).abs().max() / reference.abs().max()).item()
