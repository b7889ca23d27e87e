"""What the launcher tests (no GPU) launch with: device tensors at a made-up address, a kernel library that
hands out names, and each kernel's parameter types as its .cu source declares them."""

import re

import numpy as np

from metrale.runtime.backend.cuda.compiler import kernel_sources
from metrale.runtime.backend.cuda.launch import kernel_arg
from metrale.runtime.backend.cuda.tensor import DeviceTensor, Fp8KvTensor

BASE = 1 << 32   # a made-up device address, 256-byte aligned


def bf16(*shape, offset=0, row_stride=None):
    return DeviceTensor(BASE + offset, shape, "bfloat16", row_stride)


def f32(*shape, offset=0, row_stride=None):
    return DeviceTensor(BASE + offset, shape, "float32", row_stride)


def i32(*shape, offset=0):
    return DeviceTensor(BASE + offset, shape, "int32")


def fp8_kv(*shape, offset=0, scales_offset=1 << 28):
    """An FP8 KV cache layer [2, blocks, block_size, kv_heads, head_dim] with its [2, kv_heads] scales."""
    return Fp8KvTensor(BASE + offset, shape, "float8_e4m3", scales=f32(2, shape[3], offset=scales_offset))


def parameter_types(module: str, kernel: str, macro: str | None = None) -> list[type]:
    """The numpy type kernel_arg must produce for each parameter of `kernel` in cuda_kernels/<module>.cu; macro:
    the #define that declares it (kernels a macro stamps out per head size; object-like macros in its parameter
    list, such as decode_attention.cuh's DECODE_PARAMS, are expanded)."""
    source = kernel_sources()[module].replace("\\\n", " ")
    if macro is None:
        match = re.search(rf'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?{kernel}\(([^)]*)\)',
                          source)
    else:
        match = re.search(rf'#define {macro}\(.*?__global__ void (?:__launch_bounds__\([^)]*\) )?[\w#]+\(([^)]*)\)',
                          source)
    assert match, f"no kernel {kernel} in {module}.cu"
    parameters = match.group(1)
    for name, body in re.findall(r"#define (\w+)[ \t]+([^\n]*)", source):
        parameters = re.sub(rf"\b{name}\b", body, parameters)
    types = []
    for parameter in parameters.split(","):
        declaration = " ".join(parameter.split())
        if "*" in declaration:
            types.append(np.uint64)
        elif declaration.startswith("long long"):
            types.append(np.int64)
        elif declaration.startswith("int"):
            types.append(np.int32)
        elif declaration.startswith("float"):
            types.append(np.float32)
        else:
            raise AssertionError(f"unexpected parameter {declaration!r} of {kernel}")
    return types


def record_launches(monkeypatch, *modules) -> list:
    """launch_kernel replaced in each launcher module: every launch appended as (kernel, grid, block, args, shmem),
    the kernel as FakeLibrary hands it out and each argument as kernel_arg converts it; nothing reaches a GPU."""
    recorded = []

    def record(stream, kernel, grid, block, *args, shmem=0):
        recorded.append((kernel, grid, block, [kernel_arg(a) for a in args], shmem))

    for module in modules:
        monkeypatch.setattr(module, "launch_kernel", record)
    return recorded


class FakeLibrary:
    """Stands in for KernelLibrary: get() returns (module, kernel name) and records the request."""
    arch = "sm_90a"

    def __init__(self):
        self.requested = []

    def get(self, kernel_name, module):
        self.requested.append((module, kernel_name))
        return module, kernel_name

    def get_with_shared(self, kernel_name, module, shared_bytes):
        assert shared_bytes <= 227 * 1024, f"{kernel_name}: {shared_bytes} bytes of shared memory"
        return self.get(kernel_name, module)

    def max_block(self, kernel_name, module):
        return 1024
