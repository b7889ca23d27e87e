"""CUTLASS's sm90 GEMM (TMA warp-specialized, wgmma; bench/cutlass_probe.py) built by NVRTC with programmatic
dependent launch, against our cuBLASLt linear at a beam step's 64 rows: correct against torch, and µs per launch in
a CUDA graph of back-to-back launches over weights spanning 3x the L2 (bench/gpu_skinny_gemm.py's method). The
question (bench/NOTES.md, session 11): does a GEMM that takes part in PDL reach cuBLASLt's time, so that the ~150
dependent launches of a decode step can overlap? Each row gives the time per launch of GEMMs back to back, and per
(layer_norm, GEMM) pair with the GEMM reading the norm's output, as a decode layer's linears follow a norm.

The kernels, their sources and their build are bench/cutlass_kernels.py's. Each one's Params (640 bytes at a 64 x 64
tile) are built on the device: a helper kernel in the same module runs
CUTLASS's own to_underlying_arguments (NVRTC compiles it as device code; under NVRTC it leaves the TMA
descriptors empty) and copies in the two descriptors, which the host encodes (cuTensorMapEncodeTiled) as CUTLASS's
host code would: 3-D (K, rows, 1), a box of 64 K by the tile's rows, 128-byte swizzle.

A launch that does not finish within 5 s ends the process (finish_or_exit): a descriptor that disagrees with the
kernel would leave it spinning on its TMA barrier. Session 12 ran the plain variant (bench/NOTES.md): correct, and
only the 64 x 8 x 128 tile at 1024 x 1024 beat cuBLASLt; its producer waits for the kernel before it ahead of any
load, so a norm before it costs nearly as much as before cuBLASLt. The prefetch variants (CUTLASS's example 63,
whose warp loading the weight does not wait; with no bias, a bias, or a bias and ReLU in the epilogue) ask whether
loading weights ahead of the wait pays; built (session 12), not yet run.

Two steps, since the GPU machine has no CUTLASS headers (carry .cutlass):
    python3 -m bench.gpu_cutlass_gemm build --headers /tmp/cutlass-headers --out .cutlass   (here: cubins)
    python3 -m bench.gpu_cutlass_gemm run --cubins .cutlass                                 (on the GPU)
"""

import argparse
import ctypes
import json
from pathlib import Path

import numpy as np

from bench.cutlass_kernels import BIASED, EPILOGUES, RATIOS, TILES, build, cubin_name

SHAPES = (("o", 1024, 1024), ("qkv", 3072, 1024), ("fc1", 4096, 1024), ("fc2", 1024, 4096))
ROWS = (64, 16)


class Void:
    """A kernel's parameters for cuLaunchKernel(Ex): each one's bytes kept alive, and the void** to them."""

    def __init__(self, *values):
        self.buffers = [ctypes.create_string_buffer(bytes(v), len(bytes(v))) for v in values]
        self.array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(b) for b in self.buffers])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def check(result):
    from cuda.bindings import driver

    error, *rest = result if isinstance(result, tuple) else (result,)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver: {error}")
    return rest[0] if len(rest) == 1 else rest


def tma_descriptor(ptr: int, rows: int, k: int, ld: int, box_rows: int) -> bytes:
    """A [rows, k] bf16 row-major matrix (row stride ld elements) as CUTLASS's K-major TMA load sees it: 16-bit
    elements as CUTLASS encodes bf16 (its TmaInternalType is uint16_t), dims (K, rows, L = 1), a 64 x box_rows box
    (64 bf16 = the 128-byte swizzle's span), out-of-bounds rows read as zeros."""
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tensor_map = check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, ptr,
        [u64(k), u64(rows), u64(1)], [u64(ld * 2), u64(rows * ld * 2)], [u32(64), u32(box_rows), u32(1)],
        [u32(1), u32(1), u32(1)], driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return np.array([int(word) for word in tensor_map.opaque], dtype=np.uint64).tobytes()


class CutlassLinear:
    """out [M, N] = x [M, K] @ weight [N, K]^T in bf16 (float accumulation), by one variant's and tile's cubin."""

    def __init__(self, cubin: bytes, variant: str, tile, ratios: tuple[float, float] = (0.5, 0.5)):
        from cuda.bindings import driver

        self.variant, self.tile, self.ratios = variant, tile, ratios
        image = np.frombuffer(cubin, dtype=np.uint8).copy()
        self.module = check(driver.cuModuleLoadData(image.ctypes.data))
        self.gemm = check(driver.cuModuleGetFunction(self.module, b"cutlass_gemm"))
        self.params_kernel = check(driver.cuModuleGetFunction(self.module, b"cutlass_gemm_params"))

    def prepare(self, out, x, weight, bias) -> tuple:
        """The launch of out = x weight^T (+ bias, then relu, for the variants with those) for these tensors (torch,
        on the GPU): Params bytes, grid, shared bytes, threads."""
        import torch
        from cuda.bindings import driver

        params = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        info = torch.zeros(8, dtype=torch.int32, device="cuda")
        # The plain variant's A is x (tokens as M), the prefetch variants' the weight (features as M).
        a, b = (weight, x) if self.variant in EPILOGUES else (x, weight)
        (m, k), n = a.shape, b.shape[0]
        desc_a = tma_descriptor(a.data_ptr(), m, k, a.stride(0), self.tile[0])
        desc_b = tma_descriptor(b.data_ptr(), n, k, b.stride(0), self.tile[1])
        p = lambda v: np.uint64(v).tobytes()     # noqa: E731
        i32 = lambda v: np.int32(v).tobytes()     # noqa: E731
        i64 = lambda v: np.int64(v).tobytes()     # noqa: E731
        f32 = lambda v: np.float32(v).tobytes()   # noqa: E731
        values = [p(params.data_ptr()), p(info.data_ptr()), desc_a, desc_b, i32(m), i32(n), i32(k), p(a.data_ptr()),
                  i64(a.stride(0)), p(b.data_ptr()), i64(b.stride(0)), p(out.data_ptr()), i64(out.stride(0)),
                  p(out.data_ptr()), i64(out.stride(0)), f32(1.0), f32(0.0)]
        if self.variant in EPILOGUES:
            values += [f32(self.ratios[0]), f32(self.ratios[1])]
        if self.variant in BIASED:
            values.append(p(bias.data_ptr()))
        args = Void(*values)
        torch.cuda.synchronize()
        check(driver.cuLaunchKernel(self.params_kernel, 1, 1, 1, 1, 1, 1, 0, 0, args.address, 0))
        check(driver.cuCtxSynchronize())
        grid_x, grid_y, grid_z, size, shared, threads = info.cpu().tolist()[:6]
        check(driver.cuFuncSetAttribute(
            self.gemm, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared))
        return Void(params.cpu().numpy()[:size].tobytes()), (grid_x, grid_y, grid_z), shared, threads

    def launch(self, stream_handle: int, prepared, pdl: bool = True) -> None:
        from cuda.bindings import driver

        params, grid, shared, threads = prepared
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = shared
        config.hStream = driver.CUstream(stream_handle)
        attributes = []
        if pdl:
            attribute = driver.CUlaunchAttribute()
            attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        config.attrs, config.numAttrs = attributes, len(attributes)
        check(driver.cuLaunchKernelEx(config, self.gemm, params.address, 0))


def finish_or_exit(stream, what: str, seconds: float = 5.0) -> None:
    """Waits for the stream's work, or ends the process: a TMA load whose descriptor disagrees with the bytes the
    kernel expects never completes its barrier, and the kernel would spin until the machine's time is spent."""
    import os
    import time

    event, deadline = stream.record(), time.monotonic() + seconds
    while not event.is_done:
        if time.monotonic() > deadline:
            print(f"{what}: not finished after {seconds} s (a hung TMA barrier?); ending the process", flush=True)
            os._exit(3)
        time.sleep(0.001)


def run(cubins: Path) -> list[dict]:
    import torch

    from bench.gpu_ceilings import gpu_machine_line
    from bench.gpu_skinny_gemm import L2_SPAN, WORKSPACE_BYTES
    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.gemm import CublasLt
    from metrale.runtime.backend.cuda.tensor import DeviceTensor
    from metrale.runtime.default_model import default_cache_dir

    print(gpu_machine_line("gpu_cutlass_gemm", "cuda"), flush=True)
    cuda = CudaDevice()
    lib = KernelLibrary(cuda.arch, KernelCache(default_cache_dir() / "kernels"))
    lt = CublasLt(DeviceTensor.from_torch(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")))
    linears = {}
    for variant, tile in TILES:
        for ratios in RATIOS if variant == "prefetch" else [RATIOS[0]] if variant in BIASED else [None]:
            label = f"{variant[:3]} {'x'.join(map(str, tile))}" + (f" {ratios[0]}/{ratios[1]}" if ratios else "")
            try:
                cubin = (cubins / cubin_name(variant, tile)).read_bytes()
                linears[label] = CutlassLinear(cubin, variant, tile, *([ratios] if ratios else []))
            except Exception as error:      # noqa: BLE001 - a probe reports and goes on
                print(f"{label}: load failed: {error!r}", flush=True)
    print("us per launch in a graph of back-to-back GEMMs, and per (layer_norm, GEMM) pair (the GEMM reading the "
          "norm's output, as a decode layer's are); relative error against torch", flush=True)
    print(f"{'linear':<6} {'rows':>4}  {'kernel':<24} {'alone':>7} {'pair':>7} {'pair-cuBLASLt':>13}  error",
          flush=True)
    results = []
    for name, n, k in SHAPES:
        copies = -(-L2_SPAN * torch.cuda.get_device_properties(0).L2_cache_size // (n * k * 2))
        weights = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
        for m in ROWS:
            case = Case(cuda.stream, lib, lt, weights, m, max(24, copies))
            row = {"linear": name, "rows": m, "cuBLASLt": case.timings(case.cublaslt)}
            base = row["cuBLASLt"]["norm_gemm_us"]
            _print_timing(name, m, "cuBLASLt", row["cuBLASLt"], base)
            for label, linear in linears.items():      # each printed as it comes: a hang ends the process
                try:
                    row[label] = case.cutlass(linear, f"{name} at {m} rows, {label}")
                    _print_timing(name, m, label, row[label], base)
                except Exception as failure:      # noqa: BLE001 - a probe reports and goes on
                    row[label] = repr(failure)
                    print(f"{name:<6} {m:>4}  {label:<24} failed: {failure!r}", flush=True)
            results.append(row)
        del weights
    lt.close()
    return results


def _print_timing(name: str, m: int, label: str, timing: dict, base: float) -> None:
    error = f"{timing['rel_err']:.0e}" if "rel_err" in timing else "-"
    print(f"{name:<6} {m:>4}  {label:<24} {timing['gemm_us']:7.2f} {timing['norm_gemm_us']:7.2f} "
          f"{timing['norm_gemm_us'] - base:+13.2f}  {error}", flush=True)


class Case:
    """One linear shape at m rows: x, its normed copy, the weight copies (spanning 3x the L2), the output."""

    def __init__(self, stream, lib, lt, weights: list, m: int, count: int):
        import torch

        from metrale.runtime.backend.cuda.tensor import DeviceTensor

        k = weights[0].shape[1]
        self.stream, self.lib, self.lt, self.weights, self.count = stream, lib, lt, weights, count
        self.x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        self.normed = torch.empty_like(self.x)
        self.norm_weight = torch.ones(k, dtype=torch.bfloat16, device="cuda")
        self.norm_bias = torch.zeros(k, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty(m, weights[0].shape[0], dtype=torch.bfloat16, device="cuda")
        self.bias = torch.randn(weights[0].shape[0], device="cuda").to(torch.bfloat16)
        self.views = {name: DeviceTensor.from_torch(t) for name, t in (
            ("x", self.x), ("normed", self.normed), ("norm_weight", self.norm_weight), ("norm_bias", self.norm_bias),
            ("out", self.out))}
        self.weight_views = [DeviceTensor.from_torch(w) for w in weights]

    def norm(self) -> None:
        from metrale.runtime.backend.cuda.kernels.norm import layer_norm

        v = self.views
        layer_norm(self.lib, self.stream, v["normed"], v["x"], v["norm_weight"], v["norm_bias"], 1e-5)

    def cublaslt(self, i: int, source: str) -> None:
        self.lt.linear(self.stream, self.views["out"], self.views[source], self.weight_views[i % len(self.weights)])

    def timings(self, gemm) -> dict:
        """gemm(i, source): the i-th launch, reading views[source]."""
        from bench.gpu_skinny_gemm import time_per_launch

        gemm(0, "x")                     # plans cuBLASLt's shape outside the capture
        self.stream.sync()
        alone = time_per_launch(self.stream, [lambda i=i: gemm(i, "x") for i in range(self.count)])
        paired = time_per_launch(self.stream, [lambda i=i: (self.norm(), gemm(i, "normed"))
                                               for i in range(self.count)])
        return {"gemm_us": alone * 1e6, "norm_gemm_us": paired * 1e6}

    def cutlass(self, linear: CutlassLinear, what: str) -> dict:
        """Correct against torch first (one launch, waited for with a deadline), then timed."""
        handle = int(self.stream.handle)
        prepared = {source: [linear.prepare(self.out, getattr(self, source), w, self.bias) for w in self.weights]
                    for source in ("x", "normed")}
        self.out.zero_()
        linear.launch(handle, prepared["x"][0], pdl=False)
        finish_or_exit(self.stream, what)
        expected = self.x.float() @ self.weights[0].float().T
        if linear.variant in BIASED:
            expected = expected + self.bias.float()
        if linear.variant == "prefetch_relu":
            expected = expected.clamp(min=0)
        error = float((self.out.float() - expected).norm() / expected.norm())
        timing = self.timings(lambda i, source: linear.launch(handle, prepared[source][i % len(self.weights)]))
        return {**timing, "rel_err": error}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    making = sub.add_parser("build")
    making.add_argument("--headers", type=Path, required=True)
    making.add_argument("--out", type=Path, default=Path(".cutlass"))
    running = sub.add_parser("run")
    running.add_argument("--cubins", type=Path, default=Path(".cutlass"))
    running.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.headers, args.out)
        return None
    results = run(args.cubins)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
