"""NVRTC compilation of metrale/cuda_kernels/*.cu to cubin, with an on-disk cache.

Always cubin, never PTX: the driver may be older than NVRTC and reject newer PTX. The cache key is the
source (with its headers), the options and the NVRTC version, so a second start compiles nothing.
"""

import hashlib
import os
import re
import threading
from importlib import resources
from pathlib import Path

from cuda.bindings import driver, nvrtc
from cuda.core import Device, ObjectCode, Program, ProgramOptions

from metrale.runtime.backend.cuda.device import check
from metrale.runtime.backend.cuda.launch import use_programmatic_launch
from metrale.runtime.errors import FailedPrecondition

# Each .cu is compiled with the headers it includes from cuda_kernels/ pasted in (each once, in include order),
# so NVRTC needs no include path.
INCLUDE = re.compile(r'^#include "(\w+\.cuh)"[ \t]*$', re.M)
OPTIONS = {"std": "c++17", "lineinfo": True}
DEFAULT_SHARED_BYTES = 48 * 1024   # dynamic shared memory a kernel may take without opting in


def kernel_sources() -> dict[str, str]:
    """name (file stem) -> CUDA C++ source of every .cu in metrale/cuda_kernels, its .cuh includes inlined."""
    folder = resources.files("metrale") / "cuda_kernels"
    sources = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".cu"):
            sources[entry.name.removesuffix(".cu")] = _inline_headers(entry.read_text(), folder, set())
    return sources


def with_headers(source: str) -> str:
    """A source from outside cuda_kernels/ (a benchmark's variant of a package kernel, bench/kernel_variant.py) with
    the .cuh headers it includes from there inlined, as kernel_sources() inlines them."""
    return _inline_headers(source, resources.files("metrale") / "cuda_kernels", set())


def _inline_headers(text: str, folder, seen: set[str]) -> str:
    def paste(match):
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _inline_headers((folder / name).read_text(), folder, seen)
    return INCLUDE.sub(paste, text)


def nvrtc_version() -> str:
    result, major, minor = nvrtc.nvrtcVersion()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise FailedPrecondition(f"NVRTC is not usable: {result.name}")
    return f"{major}.{minor}"


def arch_number(arch: str) -> int:
    """An NVRTC target's compute capability as a number: 'sm_90a' -> 90, 'sm_89' -> 89."""
    return int(arch[3:].rstrip("af"))


def compile_cubin(name: str, source: str, arch: str) -> bytes:
    """arch: 'sm_90a', 'sm_89', 'sm_80', ... Raises FailedPrecondition with the NVRTC log."""
    options = ProgramOptions(arch=arch, name=f"{name}.cu", **OPTIONS)
    try:
        code = Program(source, "c++", options).compile("cubin")
    except Exception as error:  # cuda.core puts the NVRTC log in the message
        raise FailedPrecondition(f"NVRTC failed on {name}.cu for {arch}: {error}") from None
    return bytes(code.code)


class KernelCache:
    """cubin files under cache_dir, one per (source, arch, options, NVRTC version)."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        self.hits = 0
        self.misses = 0

    def cubin(self, name: str, source: str, arch: str) -> bytes:
        settings = [f"{k}={v}" for k, v in sorted(OPTIONS.items())]
        key = hashlib.sha256("\0".join([source, arch, *settings, nvrtc_version()]).encode()).hexdigest()[:24]
        path = self.cache_dir / f"{name}-{arch}-{key}.cubin"
        if path.exists():
            self.hits += 1
            return path.read_bytes()
        self.misses += 1
        cubin = compile_cubin(name, source, arch)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(cubin)
        partial.replace(path)
        return cubin


def allow_dynamic_shared(kernel, shared_bytes: int) -> None:
    """Lets a loaded kernel launch with shared_bytes of dynamic shared memory on the current device."""
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(driver.cuKernelSetAttribute(attribute, shared_bytes, kernel.handle, Device().device_id))


class KernelLibrary:
    """Every kernel of metrale/cuda_kernels loaded for one device: get('rms_norm_residual') -> Kernel."""

    def __init__(self, arch: str, cache: KernelCache, programmatic_launch: bool = True):
        """programmatic_launch: launch with PDL where the arch has it (Hopper and up)."""
        self._kernels = {}
        self._modules = {}
        self._resident = {}
        self._max_block = {}
        self._shared = {}          # (module, kernel) -> the dynamic shared memory it may take, where above 48 KB
        # A module is loaded into the context on its first get_kernel, and streams launch from several threads.
        self._load_lock = threading.Lock()
        self.cache = cache
        for name, source in kernel_sources().items():
            self._modules[name] = ObjectCode.from_cubin(cache.cubin(name, source, arch))
        self.arch = arch
        use_programmatic_launch(programmatic_launch and arch_number(arch) >= 90)

    def get(self, kernel_name: str, module: str):
        kernel = self._kernels.get((module, kernel_name))
        return kernel if kernel is not None else self._load(kernel_name, module)

    def _load(self, kernel_name: str, module: str):
        with self._load_lock:
            key = (module, kernel_name)
            if key not in self._kernels:
                self._kernels[key] = self._modules[module].get_kernel(kernel_name)
            return self._kernels[key]

    def get_with_shared(self, kernel_name: str, module: str, shared_bytes: int):
        """get(), the kernel allowed shared_bytes of dynamic shared memory: above the 48 KB any kernel may take, a
        kernel opts in (once, before its first launch with that much)."""
        kernel = self.get(kernel_name, module)
        key = (module, kernel_name)
        if shared_bytes > self._shared.get(key, DEFAULT_SHARED_BYTES):
            with self._load_lock:
                allow_dynamic_shared(kernel, shared_bytes)
                self._shared[key] = shared_bytes
        return kernel

    def max_block(self, kernel_name: str, module: str) -> int:
        """The most threads a block of the kernel can have (its registers set it), in whole warps."""
        key = (module, kernel_name)
        if key not in self._max_block:
            self._max_block[key] = self.get(kernel_name, module).attributes.max_threads_per_block // 32 * 32
        return self._max_block[key]

    def resident_ctas(self, kernel_name: str, module: str, threads: int, shared_bytes: int = 0) -> int:
        """CTAs of `threads` threads (and shared_bytes of dynamic shared memory) the whole device runs at once."""
        key = (module, kernel_name, threads, shared_bytes)
        if key not in self._resident:
            kernel = self.get_with_shared(kernel_name, module, shared_bytes)
            per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(threads, shared_bytes)
            self._resident[key] = max(1, per_sm) * Device().properties.multiprocessor_count
        return self._resident[key]
