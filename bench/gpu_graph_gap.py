"""Where a CUDA graph's launch costs device time: the device's idle gap between the kernel before a graph launch and
the graph's first kernel, by the graph's node count, whether the kernel before it is launched with programmatic
stream serialization (PDL) and whether the graph's kernels were captured with it (CUPTI through torch.profiler).

The beam search's decode step launches its forward graph (~470 kernels) after its own search kernels, and the
kernel tables show ~12-17 µs idle before the graph's first kernel each step; this says whether that is the
launch's own cost, and what it grows with. Each graph is N row gathers (gather_rows_16b, 8 bf16 values a row);
the kernel before it another (gather_rows_4b), or nothing (graph after graph).

Run from the repository root: python3 -m bench.gpu_graph_gap [--nodes 1,8,64,470] [--launches 20]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_ceilings import gpu_machine_line


def capture(stream, launches) -> object:
    builder = stream.create_graph_builder()
    builder.begin_building("thread_local")
    try:
        launches()
    finally:
        builder.end_building()
    graph = builder.complete()
    graph.upload(stream)
    return graph


def gaps(events: list[tuple[int, int, str]], nodes: int, before: bool) -> tuple[float, float]:
    """(median idle before each graph's first kernel, median idle between kernels inside a graph), µs; negative
    where a kernel started before the one ahead of it ended (PDL)."""
    kernels = [e for e in events if e[2].startswith("gather_rows")]
    first, inside = [], []
    for i in range(1, len(kernels)):
        start, _, name = kernels[i]
        if name.endswith("16b"):
            previous = kernels[i - 1]
            starts_graph = previous[2].endswith("4b") if before else i % nodes == 0
            (first if starts_graph else inside).append(start - previous[1])
    median = lambda values: statistics.median(values) / 1e3 if values else float("nan")
    return median(first), median(inside)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="64,470")
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args(argv)
    from cuda.bindings import driver

    from metrale.runtime.backend.cuda import launch
    from metrale.runtime.backend.cuda.compiler import KernelCache, KernelLibrary
    from metrale.runtime.backend.cuda.device import CudaDevice
    from metrale.runtime.backend.cuda.kernels.embedding import gather_rows
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    device = CudaDevice(0)
    lib = KernelLibrary(device.arch, KernelCache(Path("/tmp/metrale-bench-kernels")))
    pdl = launch.programmatic_launch()
    stream = device.stream
    view = lambda t: DeviceTensor.from_torch(t)
    rows = view(torch.arange(64, dtype=torch.int32, device="cuda"))
    wide_in, wide_out = (torch.ones(64, 8, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    narrow_in, narrow_out = (torch.ones(64, 1, dtype=torch.float32, device="cuda") for _ in range(2))
    node = lambda: gather_rows(lib, stream, view(wide_out), view(wide_in), rows)
    previous = lambda: gather_rows(lib, stream, view(narrow_out), view(narrow_in), rows)
    # A copy ahead of the timed launches holds the stream (~10 ms) until the host has queued them all: the gaps are
    # then the device's own, as in a beam step, whose host runs a step ahead.
    block_src, block_dst = (torch.empty(4 << 30, dtype=torch.uint8, device="cuda") for _ in range(2))
    hold = lambda: [driver.cuMemcpyDtoDAsync(block_dst.data_ptr(), block_src.data_ptr(), block_src.numel(),
                                             int(stream.handle)) for _ in range(4)]

    def captured(nodes: int, mode: str):
        def launches():
            for i in range(nodes):
                launch.use_programmatic_launch(pdl and (mode == "all" or (mode == "not first" and i > 0)))
                node()
        return capture(stream, launches)

    print(gpu_machine_line("gpu_graph_gap", "cuda"))
    print(f"{'nodes':>5}  {'graph PDL':>9}  {'before':<12} {'idle before graph us':>20} {'idle inside us':>14} "
          f"{'host us a launch':>16} {'(profiled)':>10}")
    results = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for mode in ("all", "not first", "none"):
            graph = captured(nodes, mode)
            for before in ("PDL kernel", "plain kernel", "nothing"):
                launch.use_programmatic_launch(pdl and before == "PDL kernel")
                for _ in range(2):
                    graph.launch(stream)
                stream.sync()
                def queue() -> float:
                    """The timed launches behind the hold: host µs a launch."""
                    hold()
                    started = time.perf_counter()
                    for _ in range(args.launches):
                        if before != "nothing":
                            previous()
                        graph.launch(stream)
                    elapsed = (time.perf_counter() - started) / args.launches * 1e6
                    stream.sync()
                    return elapsed

                plain_us = queue()                     # CUPTI's tracing slows each graph launch, per node
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    host_us = queue()
                events = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                                for e in prof.profiler.kineto_results.events()
                                if e.device_type() == torch.autograd.DeviceType.CUDA)
                idle, inside = gaps(events, nodes, before != "nothing")
                print(f"{nodes:5d}  {mode:>9}  {before:<12} {idle:20.2f} {inside:14.2f} {plain_us:16.1f} "
                      f"{host_us:10.1f}")
                results.append({"nodes": nodes, "graph_pdl": mode, "before": before, "idle_us": idle,
                                "inside_us": inside, "host_us": plain_us,
                                "profiled_host_us": host_us})
    launch.use_programmatic_launch(pdl)
    return results


if __name__ == "__main__":
    main()
