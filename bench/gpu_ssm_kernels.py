"""The Mamba2 kernels alone on the GPU at the Nemotron-H-8B mixer's shape (128 heads of 64, 8 groups, a 128-wide
state, conv width 4): a decode step's conv and scan at each batch, as a fraction of copy bandwidth (every sequence's
state read and written over the time), and one prompt's scan, token by token (`ssm_scan`) and chunked
(`chunked_scan`, chunks of 128), in ms. `--variant NAME=FILE` times another ssm.cu beside the package's in the same
run; each variant's outputs are checked against the package's: the largest difference of y, and of the states
(conv and SSM), over the largest magnitude of the package's.

Run from the repository root: python3 -m bench.gpu_ssm_kernels [--variant before=/tmp/ssm.cu]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gpu_machine_line
from bench.kernel_variant import add_variant_option, bench_libraries, relative_diff, time_launch_us

HEADS, HEAD_DIM, GROUPS, STATE, WIDTH, CHUNK = 128, 64, 8, 128, 4, 128
INNER = HEADS * HEAD_DIM
CHANNELS = INNER + 2 * GROUPS * STATE
DECODE_BATCHES = (1, 32, 128)
PROMPTS = (1024, 8192)
LAUNCHES = 8                                  # launches a timed graph


class Inputs:
    """One forward's tensors for `segments` (length, source slot, destination slot) each, every sequence's slots
    distinct; the layer's parameters."""

    def __init__(self, segments: list[tuple[int, int, int]], slots: int):
        from metrale.runtime.backend.cuda.kernels import ssm
        from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
        tokens = sum(n for n, _, _ in segments)
        lens = [n for n, _, _ in segments]
        as_int = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
        self.kept = [as_int([sum(lens[:i]) for i in range(len(lens))]), as_int(lens),
                     as_int([s for _, s, _ in segments]), as_int([d for _, _, d in segments])]
        self.segments = ssm.Segments(*(D.from_torch(t) for t in self.kept), len(segments), max(lens))
        self.x = (torch.randn(tokens, CHANNELS, device="cuda") * 0.5).bfloat16()
        self.weight = (torch.randn(CHANNELS, WIDTH, device="cuda") * 0.3).bfloat16()
        self.bias = torch.randn(CHANNELS, device="cuda").bfloat16()
        self.dt = torch.randn(tokens, HEADS, device="cuda").bfloat16()
        self.A = -torch.empty(HEADS, device="cuda").uniform_(0.05, 0.5)
        self.D, self.dt_bias = torch.randn(HEADS, device="cuda"), torch.randn(HEADS, device="cuda") - 1.0
        self.conv_state = torch.randn(slots, CHANNELS, WIDTH - 1, device="cuda")
        self.ssm_state = 0.3 * torch.randn(slots, HEADS, HEAD_DIM, STATE, device="cuda")
        self.conv_out = torch.empty_like(self.x)
        self.y = torch.empty(tokens, INNER, device="cuda").bfloat16()
        chunk_slots = ssm.chunk_slots(tokens, self.segments, CHUNK)
        self.chunk_states = torch.empty(chunk_slots, INNER * STATE, device="cuda")
        self.chunk_decays = torch.empty(chunk_slots, HEADS, device="cuda")

    def conv(self, lib, stream):
        from metrale.runtime.backend.cuda.kernels import ssm
        from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
        return lambda: ssm.conv(lib, stream, D.from_torch(self.conv_out), D.from_torch(self.x),
                                D.from_torch(self.weight), D.from_torch(self.bias), D.from_torch(self.conv_state),
                                self.segments)

    def scan(self, lib, stream, chunked: bool):
        from metrale.runtime.backend.cuda.kernels import ssm
        from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
        args = (D.from_torch(self.y), D.from_torch(self.x), D.from_torch(self.dt), D.from_torch(self.A),
                D.from_torch(self.D), D.from_torch(self.dt_bias), D.from_torch(self.ssm_state), self.segments, GROUPS,
                0.001, float("inf"))
        if chunked:
            workspace = (D.from_torch(self.chunk_states), D.from_torch(self.chunk_decays))
            return lambda: ssm.chunked_scan(lib, stream, *args, CHUNK, *workspace)
        return lambda: ssm.scan(lib, stream, *args)


def outputs(inputs: Inputs, launch, stream) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch's outputs from fixed inputs (the states restored first): the activations (the conv's and y) and
    the states, each flattened."""
    conv_state, ssm_state = inputs.conv_state.clone(), inputs.ssm_state.clone()
    torch.cuda.synchronize()
    launch()
    stream.sync()
    out = (torch.cat([inputs.conv_out.float().flatten(), inputs.y.float().flatten()]),
           torch.cat([inputs.conv_state.flatten(), inputs.ssm_state.flatten()]))
    inputs.conv_state.copy_(conv_state)
    inputs.ssm_state.copy_(ssm_state)
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_variant_option(parser, "ssm.cu")
    args = parser.parse_args(argv)
    device, libraries = bench_libraries("ssm", args.variant)
    stream = device.stream
    print(gpu_machine_line("gpu_ssm_kernels", "cuda"))
    bandwidth = copy_bandwidth("cuda", 2 * 10**9)
    state_bytes = 4 * (HEADS * HEAD_DIM * STATE + CHANNELS * (WIDTH - 1))
    print(f"# {HEADS} heads of {HEAD_DIM}, {GROUPS} groups, state {STATE}, conv {WIDTH}: {state_bytes / 1e6:.2f} MB of "
          f"state a sequence and layer; copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    print(f"{'case':<22} {'variant':<12} {'conv us':>8} {'scan us':>9} {'x copy':>6} {'y diff':>9} {'state diff':>10}")
    results = []
    cases = [(f"decode batch {b}", [(1, 2 * i, 2 * i + 1) for i in range(b)], 2 * b, False) for b in DECODE_BATCHES]
    cases += [(f"prompt {n} {kind}", [(n, -1, 0)], 1, kind == "chunked") for n in PROMPTS
              for kind in ("sequential", "chunked")]
    for name, segments, slots, chunked in cases:
        inputs = Inputs(segments, slots)
        reference = None
        for variant, lib in libraries.items():
            conv, scan = inputs.conv(lib, stream), inputs.scan(lib, stream, chunked)
            got = outputs(inputs, lambda: (conv(), scan()), stream)
            reference = got if reference is None else reference
            y_diff, state_diff = (relative_diff(g, r) for g, r in zip(got, reference))
            conv_us, scan_us = time_launch_us(stream, conv, LAUNCHES), time_launch_us(stream, scan, LAUNCHES)
            decode = name.startswith("decode")
            moved = len(segments) * 2 * state_bytes if decode else float("nan")
            fraction = moved / ((conv_us + scan_us) / 1e6) / bandwidth if decode else float("nan")
            results.append({"case": name, "variant": variant, "conv_us": conv_us, "scan_us": scan_us,
                            "fraction_of_copy": fraction, "y_diff": y_diff, "state_diff": state_diff})
            print(f"{name:<22} {variant:<12} {conv_us:8.1f} {scan_us:9.1f} {fraction:6.2f} {y_diff:9.2e} "
                  f"{state_diff:10.2e}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
