"""Dense GEMMs on cuBLASLt: out = x @ weight.T (+ bias), on the caller's stream and workspace, with the matmul
descriptor, the matrix layouts and the heuristic's algorithm built once per shape and cached for every stream.

cuBLASLt is reached through nvmath-python's low-level bindings (`nvmath.bindings.cublasLt`: raw pointers in,
statuses out). Neither package is loaded until a CublasLt is created, so this module imports anywhere.
libcublasLt.so.13 is found by `cuda.pathfinder` (the loader nvmath-python 1.x itself uses): first the
`nvidia-cublas` wheel (site-packages/nvidia/cu13/lib), then conda, then the system (LD_LIBRARY_PATH, ldconfig,
CUDA_HOME). We load it ourselves first so a missing library is one FailedPrecondition naming the fix.
"""

import threading
from dataclasses import replace

import numpy as np

from metrale.runtime.backend.cuda.gemm_plan import (ALIGNMENT, CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_BIAS,
                                                    CUDA_DATA_TYPE, GemmPlan, LinearKey, fp8_linear_key,
                                                    head_linear_key, linear_key)
from metrale.runtime.backend.cuda.launch import require
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import DeviceFault, FailedPrecondition, InvalidArgument


# Slots of CublasLt._pointers: which descriptor pointer a call sets.
BIAS, A_SCALE, B_SCALE = 0, 1, 2


class CublasLtError(DeviceFault):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call: str, status: str, detail: str = ""):
        self.call = call
        self.status = status
        super().__init__(f"cuBLASLt {call} failed with {status}" + (f": {detail}" if detail else ""))


def load_cublaslt():
    """nvmath.bindings.cublasLt, with libcublasLt loaded. Raises FailedPrecondition saying what is missing."""
    try:
        from cuda import pathfinder
        from nvmath.bindings import cublasLt
    except ImportError as error:
        raise FailedPrecondition(f"the CUDA backend's GEMMs need nvmath-python (pip install nvmath-python, without "
                                 f"extras: it brings no CUDA libraries of its own): {error}") from None
    try:
        pathfinder.load_nvidia_dynamic_lib("cublasLt")
    except pathfinder.DynamicLibNotFoundError as error:
        raise FailedPrecondition(f"libcublasLt.so.13 not found: pip install nvidia-cublas (the CUDA 13 wheel), or "
                                 f"put the CUDA toolkit's lib64 on LD_LIBRARY_PATH ({error})") from None
    try:
        cublasLt.get_version()  # binds every entry point; needs the driver (libcuda.so.1)
    except Exception as error:  # nvmath's NotSupportedError (no driver), RuntimeError (a symbol missing)
        raise FailedPrecondition(f"cuBLASLt is not usable here: {error}") from None
    return cublasLt


class _Matmul:
    """One shape's cuBLASLt objects: matmul descriptor, A/B/D layouts and the chosen algorithm."""

    def __init__(self, desc: int, layouts: tuple[int, int, int], heuristic):
        self.desc = desc
        self.a_layout, self.b_layout, self.d_layout = layouts
        self.heuristic = heuristic              # MatmulHeuristicResult; keeps the algo struct alive
        self.algo = heuristic.ptr               # cublasLtMatmulAlgo_t is the result struct's first field


class CublasLt:
    """A cuBLASLt handle, the per-shape cache and a default workspace, shared by every stream: each call takes
    its stream and its stream's own workspace (calls in flight on two streams must not share one). cuBLASLt may be
    called from several host threads on one handle; the lock guards what is ours to share: creating a shape's
    descriptors, and a biased call's bias pointer and an FP8 call's scale pointers, which sit in the shape's
    descriptor until the call is enqueued."""

    def __init__(self, workspace: DeviceTensor):
        require(workspace.dtype == "uint8" and len(workspace.shape) == 1 and workspace.nbytes > 0,
                f"cuBLASLt workspace must be a 1-D uint8 buffer, not {workspace.shape} {workspace.dtype}")
        require(workspace.ptr % 256 == 0, "cuBLASLt workspace must be 256-byte aligned")
        self._lt = load_cublaslt()
        self.workspace = workspace
        self._matmuls: dict[LinearKey, _Matmul] = {}
        self._lock = threading.Lock()
        self.plans_created = 0              # descriptor sets built: one per new LinearKey
        # Set while the backend warms up (gemm_tuning.py): each new shape's algorithm is then chosen by timing.
        self.tuner = None
        # Host scalars in fp32 (the scale type); POINTER_MODE_HOST reads them when a matmul is enqueued.
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        # A call's pointers that live in its shape's descriptor (BIAS, A_SCALE, B_SCALE: a bias, and an FP8 call's
        # scale vectors, the weight's and the input's), copied there from this array (cuBLASLt keeps the values).
        self._pointers = np.zeros(3, dtype=np.int64)
        attribute = self._lt.MatmulDescAttribute
        self._pointer_attributes = (attribute.BIAS_POINTER, attribute.A_SCALE_POINTER, attribute.B_SCALE_POINTER)
        # Addresses and sizes read by every call, computed once (numpy's .ctypes.data costs microseconds).
        self._alpha_address, self._beta_address = self._alpha.ctypes.data, self._beta.ctypes.data
        self._pointers_address = self._pointers.ctypes.data
        self._workspace_bytes = workspace.nbytes
        self.version = self._lt.get_version()   # e.g. 130100 for cuBLAS 13.1.0
        self._handle = self._call("cublasLtCreate", self._lt.create)

    def linear(self, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
               bias: DeviceTensor | None = None, workspace: DeviceTensor | None = None, relu: bool = False,
               splits: int = 1) -> None:
        """out [M, N] = x [M, K] @ weight [N, K].T (+ bias [N]), then max(., 0) if relu, on `stream` (a cuda.core
        Stream).
        x, weight: bf16; out: bf16 or float32 (logits); bias: out's dtype. x and out may be column slices
        (row-strided); every pointer and row stride 16-byte aligned. Accumulates in fp32. workspace: the calling
        stream's, at least as large as the one given at creation (the algorithms were chosen for that size); None:
        that one. splits > 1: out [splits * M, N] float32 takes the partial products of K's slices (LinearKey.splits),
        with no bias or relu."""
        if self._handle is None:
            raise FailedPrecondition("linear on a closed CublasLt")
        key = linear_key(out, x, weight, bias, relu, splits)
        if key.m == 0:
            return
        workspace = self._workspace_of(workspace)
        matmul = self._matmuls.get(key) or self._first_matmul(key, stream, weight, lambda w: self.linear(
            stream, out, x, w, bias, workspace, relu, splits))
        lt = self._lt
        try:
            if bias is None:
                self._enqueue(stream, matmul, out, x, weight, workspace.ptr, workspace.nbytes)
            else:
                self._enqueue_pointing(stream, matmul, ((BIAS, bias.ptr),), out, x, weight, workspace)
        except lt.cuBLASLtError as error:   # inlined _call: this is the hot path
            raise CublasLtError("cublasLtMatmul" if bias is None else "cublasLtMatmul (with bias)",
                                self._status_name(error.status)) from None

    def fp8_linear(self, stream, out: DeviceTensor, x: DeviceTensor, x_scales: DeviceTensor, weight,
                   bias: DeviceTensor | None = None, workspace: DeviceTensor | None = None, relu: bool = False) -> None:
        """out [M, N] bf16 = (x [M, K] e4m3 x x_scales [M]) @ weight.T (+ bias [N] bf16), then max(., 0) if relu:
        cuBLASLt's FP8 matmul, each operand scaled a row (OUTER_VEC_32F), fp32 accumulation. weight: an Fp8Matrix
        (data [N, K] e4m3, scales [N] float32); in blocks, each scaled a row per 128 of K (VEC128_32F): x_scales
        [K / 128, M], weight.scales [K / 128, N]. Checked by fp8_linear_key."""
        if self._handle is None:
            raise FailedPrecondition("FP8 linear on a closed CublasLt")
        key = fp8_linear_key(out, x, x_scales, weight.data, weight.scales, bias, relu, weight.blocks)
        if key.m == 0:
            return
        workspace = self._workspace_of(workspace)
        matmul = self._matmuls.get(key) or self._first_matmul(key, stream, weight.data, lambda data: self.fp8_linear(
            stream, out, x, x_scales, replace(weight, data=data), bias, workspace, relu))
        pointers = ((A_SCALE, weight.scales.ptr), (B_SCALE, x_scales.ptr)) + (((BIAS, bias.ptr),) if bias is not None else ())
        try:
            self._enqueue_pointing(stream, matmul, pointers, out, x, weight.data, workspace)
        except self._lt.cuBLASLtError as error:
            raise CublasLtError("cublasLtMatmul (FP8)", self._status_name(error.status)) from None

    def head_linear(self, stream, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, x_head_stride: int,
                    out_head_stride: int, workspace: DeviceTensor | None = None, transposed: bool = False) -> None:
        """For each head h: out's head-h columns [M, N] = x's head-h columns [M, K] @ weight[h] [N, K].T (transposed:
        @ weight[h] [K, N]), one strided batched GEMM (head_linear_key). bf16 in and out, fp32 accumulation."""
        if self._handle is None:
            raise FailedPrecondition("head linear on a closed CublasLt")
        key = head_linear_key(out, x, weight, x_head_stride, out_head_stride, transposed)
        if key.m == 0:
            return
        workspace = self._workspace_of(workspace)
        matmul = self._matmul_of(key)
        try:
            self._enqueue(stream, matmul, out, x, weight, workspace.ptr, workspace.nbytes)
        except self._lt.cuBLASLtError as error:
            raise CublasLtError("cublasLtMatmul (heads)", self._status_name(error.status)) from None

    def _workspace_of(self, workspace: DeviceTensor | None) -> DeviceTensor:
        """The call's workspace (None: the one given at creation), at least as large as the algorithms were chosen
        for."""
        workspace = self.workspace if workspace is None else workspace
        if workspace.nbytes < self._workspace_bytes:
            raise InvalidArgument(f"linear: a {workspace.nbytes}-byte workspace is smaller than the "
                                  f"{self._workspace_bytes} bytes the algorithms were chosen for")
        return workspace

    def _first_matmul(self, key: LinearKey, stream, weight: DeviceTensor, run) -> _Matmul:
        """A shape met for the first time: its descriptors, and, while a tuner is set (warm-up), its algorithm
        chosen by timing run(w) over copies w of the weight tensor."""
        matmul = self._matmul_of(key)
        if self.tuner is not None:
            self.tuner.tune(self, key, stream, weight, run)
        return matmul

    def _enqueue_pointing(self, stream, matmul: _Matmul, pointers: tuple, out: DeviceTensor, x: DeviceTensor,
                          weight: DeviceTensor, workspace: DeviceTensor) -> None:
        """_enqueue with the call's (slot, address) pointers set in the shape's descriptor first, under the lock:
        another stream's call of the shape would move them before this one is enqueued."""
        set_attribute = self._lt.matmul_desc_set_attribute
        with self._lock:
            for slot, address in pointers:
                self._pointers[slot] = address
                set_attribute(matmul.desc, self._pointer_attributes[slot], self._pointers_address + 8 * slot, 8)
            self._enqueue(stream, matmul, out, x, weight, workspace.ptr, workspace.nbytes)

    def _enqueue(self, stream, matmul: _Matmul, out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor,
                 workspace_ptr: int, workspace_bytes: int) -> None:
        self._lt.matmul(self._handle, matmul.desc, self._alpha_address, weight.ptr, matmul.a_layout, x.ptr,
                        matmul.b_layout, self._beta_address, out.ptr, matmul.d_layout, out.ptr, matmul.d_layout,
                        matmul.algo, workspace_ptr, workspace_bytes, int(stream.handle))

    def _matmul_of(self, key: LinearKey) -> _Matmul:
        """The shape's descriptors, built once: two streams may meet a new shape at the same time."""
        with self._lock:
            matmul = self._matmuls.get(key)
            if matmul is None:
                matmul = self._matmuls[key] = self._create_matmul(GemmPlan.for_linear(key))
            return matmul

    def close(self) -> None:
        """Destroys every cached descriptor and the handle; the workspace stays the caller's. Idempotent."""
        if self._handle is None:
            return
        lt = self._lt
        for matmul in self._matmuls.values():
            self._call("cublasLtMatmulDescDestroy", lt.matmul_desc_destroy, matmul.desc)
            for layout in (matmul.a_layout, matmul.b_layout, matmul.d_layout):
                self._call("cublasLtMatrixLayoutDestroy", lt.matrix_layout_destroy, layout)
        self._matmuls.clear()
        handle, self._handle = self._handle, None
        self._call("cublasLtDestroy", lt.destroy, handle)

    def __enter__(self) -> "CublasLt":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _create_matmul(self, plan: GemmPlan) -> _Matmul:
        lt = self._lt
        attr = lt.MatmulDescAttribute
        desc = self._call("cublasLtMatmulDescCreate", lt.matmul_desc_create, CUBLAS_COMPUTE_32F,
                          CUDA_DATA_TYPE["float32"])    # fp32 accumulation, fp32 alpha/beta
        layouts = []
        try:
            self._set_desc(desc, attr.TRANSA, plan.transa)
            self._set_desc(desc, attr.TRANSB, plan.transb)
            self._set_desc(desc, attr.EPILOGUE, plan.epilogue)
            if plan.epilogue & CUBLASLT_EPILOGUE_BIAS:
                self._set_desc(desc, attr.BIAS_DATA_TYPE, CUDA_DATA_TYPE[plan.d.dtype])   # = out's: see linear_key
                # The heuristic reads the bias pointer only for its alignment: address ALIGNMENT stands for every
                # bias linear_key accepts. Each call sets the real one (_enqueue_pointing).
                self._set_desc(desc, attr.BIAS_POINTER, ALIGNMENT)
            if plan.scale_mode is not None:
                for mode, pointer in ((attr.A_SCALE_MODE, attr.A_SCALE_POINTER),
                                      (attr.B_SCALE_MODE, attr.B_SCALE_POINTER)):
                    self._set_desc(desc, mode, plan.scale_mode)
                    self._set_desc(desc, pointer, ALIGNMENT)    # as the bias pointer: fp8_linear sets the real ones
            for layout in (plan.a, plan.b, plan.d):
                layouts.append(self._call("cublasLtMatrixLayoutCreate", lt.matrix_layout_create,
                                          CUDA_DATA_TYPE[layout.dtype], layout.rows, layout.cols, layout.ld))
                if layout.batch > 1:
                    self._set_layout(layouts[-1], lt.MatrixLayoutAttribute.BATCH_COUNT, layout.batch, np.int32)
                    self._set_layout(layouts[-1], lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET,
                                     layout.batch_stride, np.int64)
            heuristic = self._choose_algo(plan, desc, layouts)
        except BaseException:
            self._call("cublasLtMatmulDescDestroy", lt.matmul_desc_destroy, desc)
            for layout in layouts:
                self._call("cublasLtMatrixLayoutDestroy", lt.matrix_layout_destroy, layout)
            raise
        self.plans_created += 1
        return _Matmul(desc, tuple(layouts), heuristic)

    def _choose_algo(self, plan: GemmPlan, desc: int, layouts: list[int]):
        """The heuristic's first choice for this plan, within the workspace and ALIGNMENT."""
        return self._heuristics(plan, desc, layouts, 1)[0]

    def _heuristics(self, plan: GemmPlan, desc: int, layouts: list[int], count: int) -> list:
        """The heuristic's first `count` algorithms for this plan (fewer where it knows fewer), its best guess first:
        MatmulHeuristicResult views into one array, which they keep alive."""
        lt = self._lt
        attr = lt.MatmulPreferenceAttribute
        preference = self._call("cublasLtMatmulPreferenceCreate", lt.matmul_preference_create)
        try:
            self._set_preference(preference, attr.MAX_WORKSPACE_BYTES, self.workspace.nbytes)
            for name in ("MIN_ALIGNMENT_A_BYTES", "MIN_ALIGNMENT_B_BYTES", "MIN_ALIGNMENT_C_BYTES",
                         "MIN_ALIGNMENT_D_BYTES"):
                self._set_preference(preference, getattr(attr, name), ALIGNMENT)
            results = lt.MatmulHeuristicResult(count)
            found = np.zeros(1, dtype=np.int32)
            a_layout, b_layout, d_layout = layouts
            self._call("cublasLtMatmulAlgoGetHeuristic", lt.matmul_algo_get_heuristic, self._handle, desc,
                       a_layout, b_layout, d_layout, d_layout, preference, count, results.ptr, found.ctypes.data)
        finally:
            self._call("cublasLtMatmulPreferenceDestroy", lt.matmul_preference_destroy, preference)
        if found[0] == 0:
            raise FailedPrecondition(f"cuBLASLt has no algorithm for {plan} within a {self.workspace.nbytes}-byte "
                                     f"workspace")
        if int(results[0].state) != 0:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic", self._status_name(int(results[0].state)), str(plan))
        return [results[i] for i in range(int(found[0])) if int(results[i].state) == 0]

    def candidate_algos(self, key: LinearKey, count: int) -> list:
        """The heuristic's first `count` algorithms for key's shape (for a tuner to time), its choice first."""
        matmul = self._matmuls.get(key) or self._matmul_of(key)
        return self._heuristics(GemmPlan.for_linear(key), matmul.desc,
                                [matmul.a_layout, matmul.b_layout, matmul.d_layout], count)

    def use_algo(self, key: LinearKey, result) -> None:
        """key's shape runs `result`'s algorithm (one of candidate_algos(key)) from its next call; graphs captured
        before keep the one they captured."""
        matmul = self._matmuls.get(key) or self._matmul_of(key)
        with self._lock:
            matmul.heuristic, matmul.algo = result, result.ptr

    def _set_desc(self, desc: int, attribute, value: int) -> None:
        buffer = np.array([value], dtype=self._lt.get_matmul_desc_attribute_dtype(attribute))
        self._call("cublasLtMatmulDescSetAttribute", self._lt.matmul_desc_set_attribute, desc, attribute,
                   buffer.ctypes.data, buffer.nbytes)

    def _set_layout(self, layout: int, attribute, value: int, dtype) -> None:
        buffer = np.array([value], dtype=dtype)
        self._call("cublasLtMatrixLayoutSetAttribute", self._lt.matrix_layout_set_attribute, layout, attribute,
                   buffer.ctypes.data, buffer.nbytes)

    def _set_preference(self, preference: int, attribute, value: int) -> None:
        buffer = np.array([value], dtype=self._lt.get_matmul_preference_attribute_dtype(attribute))
        self._call("cublasLtMatmulPreferenceSetAttribute", self._lt.matmul_preference_set_attribute, preference,
                   attribute, buffer.ctypes.data, buffer.nbytes)

    def _call(self, name: str, function, *args):
        """Every cuBLASLt call but linear()'s own two goes through here (those inline it): a failing status becomes
        a CublasLtError with the status's name."""
        try:
            return function(*args)
        except self._lt.cuBLASLtError as error:
            raise CublasLtError(name, self._status_name(error.status)) from None

    def _status_name(self, status: int) -> str:
        try:
            return self._lt.get_status_name(status)
        except Exception:  # the library could not even name it
            return f"cublasStatus_t {status}"
