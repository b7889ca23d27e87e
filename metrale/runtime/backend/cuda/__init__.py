"""The CUDA backend: cuda.core device runtime, NVRTC-compiled kernels (metrale/cuda_kernels/) and cuBLASLt.
The only package that imports cuda.*."""

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metrale.runtime.backend.cuda.layer_math import CudaLayerMath
    from metrale.runtime.backend.cuda.runner import CudaRunner


def create_cuda_backend(cache_dir: Path, dtype: str = "auto", programmatic_launch: bool = True, group=None
                        ) -> tuple["CudaLayerMath", "CudaRunner"]:
    """The layer math and the runner over one device context; compiled kernels are cached under
    cache_dir/kernels. programmatic_launch: PDL on Hopper. group: a tensor-parallel worker's ranks (parallel/group.py):
    this rank runs on the visible GPU of its number, its collectives over NCCL (collectives.py). Their modules are
    imported here, so that importing the package loads no cuda.* module."""
    from metrale.runtime.backend.cuda.resources import CudaResources
    from metrale.runtime.backend.cuda.layer_math import CudaLayerMath
    from metrale.runtime.backend.cuda.runner import CudaRunner

    resources = CudaResources(cache_dir / "kernels", dtype, programmatic_launch, group)
    return CudaLayerMath(resources), CudaRunner(resources)


__all__ = ["create_cuda_backend"]
