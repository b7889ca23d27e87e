"""What the CUDA layer math and the CUDA runner share: the device, the compiled kernels, the memory plan (the
weights' arena, each stream's context, the KV pool), cuBLASLt and the calling thread's binding to a stream."""

from pathlib import Path

from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
from metrale.runtime.backend.cuda.device import Arena, CudaDevice, GrowingArena, device_count
from metrale.runtime.backend.cuda.gemm import CublasLt
from metrale.runtime.backend.cuda.stream_context import StreamContext, StreamBinding, stream_buffers, stream_bytes
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.runner import MemoryShapes
from metrale.runtime.errors import FailedPrecondition, InvalidArgument


class CudaResources:
    """One device's state. Everything but the device and the kernels exists once plan() has run."""

    def __init__(self, kernel_dir: Path, dtype: str = "auto", programmatic_launch: bool = True, group=None):
        if dtype not in ("auto", "bfloat16"):
            raise InvalidArgument(f"the CUDA backend runs bfloat16, not {dtype}")
        self.cuda = CudaDevice(0 if group is None else device_of(group.shard))
        self.lib = KernelLibrary(self.cuda.arch, KernelCache(kernel_dir), programmatic_launch)
        # A tensor-parallel rank's sums and gathers (None: one device), and its place among the ranks.
        self.collectives, self.shard = None, None
        if group is not None:
            from metrale.runtime.backend.cuda.collectives import NcclCollectives    # NCCL's only where it runs
            self.collectives, self.shard = NcclCollectives(group, self.cuda.device), group.shard
        self.shapes: MemoryShapes | None = None
        self.weights: Arena | None = None
        self.streams: list[StreamContext] = []
        self.gemm: CublasLt | None = None
        self.bound: StreamBinding | None = None
        # The KV pool as bytes, once allocated: the GEMM tuner's scratch before any sequence holds a block.
        self.kv_pool: DeviceTensor | None = None

    def plan(self, weight_bytes: int, shapes: MemoryShapes) -> None:
        """Reserves the weights' arena (weight_bytes, a bound: memory committed as the upload takes it) and places
        shapes.streams copies of a stream's buffers in one allocation; the KV pool takes what is left, later."""
        if shapes.streams < 1:
            raise InvalidArgument(f"the memory plan needs at least one stream, not {shapes.streams}")
        self.shapes = shapes
        buffers = stream_buffers(self.lib, shapes, None if self.shard is None else self.shard.size)
        per_stream = stream_bytes(buffers)
        base = self.cuda.allocate(shapes.streams * per_stream)
        # The weights' bound counts every tensor as bf16: memory is committed only as far as the upload reaches.
        self.weights = GrowingArena(self.cuda, weight_bytes, "weights")
        self.streams = [StreamContext(self.cuda, self.lib, shapes, Arena(base + i * per_stream, per_stream,
                                                                         f"stream {i}"), buffers)
                        for i in range(shapes.streams)]
        self.gemm = CublasLt(self.streams[0].gemm_workspace)
        self.bound = StreamBinding(self.streams[0])

    @property
    def stream_context(self) -> StreamContext:
        """The calling thread's stream context."""
        return self.bound.context


def device_of(shard) -> int:
    """The visible GPU a tensor-parallel rank runs on: its number's (a rank a GPU of its own)."""
    count = device_count()
    if shard.size > count:
        raise FailedPrecondition(f"--tensor-parallel {shard.size} needs {shard.size} GPUs, {count} visible")
    return shard.rank
