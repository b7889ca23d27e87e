"""Rules every CUDA kernel source keeps, read from the sources (no GPU): programmatic dependent launch's wait
first, and no activation read through the non-coherent path that the wait does not order."""

import re

from metrale.runtime.backend.cuda.compiler import kernel_sources


def test_every_kernel_waits_for_the_previous_one_first():
    # Launched with programmatic stream serialization on sm_90+, a kernel may start before its predecessor has
    # finished: its first statement must be the wait (common.cuh), in every kernel and every CTA.
    for module, source in kernel_sources().items():
        bodies = re.findall(r'extern "C" __global__ void[^{]*\{[\s\\]*([^;]*;)', source)
        assert bodies, f"{module}.cu defines no kernel"
        for first in bodies:
            assert first.strip() == "wait_for_previous_kernel();", f"{module}.cu: a kernel starts with {first!r}"


def test_no_kernel_reads_activations_through_the_non_coherent_path():
    # griddepcontrol.wait orders coherent loads only (common.cuh): ld.global.nc is kept for the skinny GEMM's
    # weights (written by no kernel); no __ldg and no __restrict__ (which lets the compiler emit such loads).
    for module, source in kernel_sources().items():
        code = "\n".join(line.split("//")[0] for line in source.splitlines())
        assert "__ldg(" not in code and "__restrict__" not in code, f"{module}.cu"
        nc = code.count("ld.global.nc")
        skinny = "skinny_gemm(" in code          # gemv.cu and moe.cu, through skinny_gemm.cuh
        assert nc == (1 if skinny else 0), f"{module}.cu has {nc} non-coherent loads"
        if nc:
            assert "ld.global.nc" in code[code.index("load_weight("):code.index("load_activation(")]
