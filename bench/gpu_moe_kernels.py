"""The mixture-of-experts kernels alone on the GPU at Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048,
experts 768 wide): one layer's routing (moe_route, with its grouping), its two grouped GEMMs (the SiLU in the first's
epilogue) and the combine, at decode batches (the experts' bytes the tokens routed to over the GEMMs' time, as a fraction of copy
bandwidth) and a prefill's rows (the GEMMs' FLOPs over their time, as a fraction of the bf16 GEMM rate).
`--variant NAME=FILE` times another moe.cu beside the package's in the same run; each variant's output is checked
against the package's (the largest difference over the largest magnitude).

Run from the repository root: python3 -m bench.gpu_moe_kernels [--variant before=/tmp/moe.cu]
"""

import argparse

import torch

from bench.gpu_ceilings import copy_bandwidth, gemm_rate, gpu_machine_line
from bench.kernel_variant import add_variant_option, bench_libraries, relative_diff, time_launch_us

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
TOKENS = (1, 8, 64, 256, 8192)
LAUNCHES = 4                                  # launches a timed graph


class Layer:
    """One layer's inputs (x, router logits, experts) for `tokens` tokens, and the buffers its kernels write."""

    def __init__(self, tokens: int):
        from metrale.runtime.backend.cuda.kernels import moe
        from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
        generator = torch.Generator(device="cuda").manual_seed(tokens)
        randn = lambda *shape, scale=1.0: (scale * torch.randn(*shape, device="cuda", generator=generator)  # noqa
                                           ).bfloat16()
        self.tokens, entries = tokens, tokens * TOP_K
        self.x = randn(tokens, HIDDEN)
        self.logits = torch.randn(tokens, EXPERTS, device="cuda", generator=generator)
        self.up = moe.interleave_gate_up(randn(EXPERTS, 2 * WIDTH, HIDDEN, scale=0.02)).contiguous()
        self.down = randn(EXPERTS, HIDDEN, WIDTH, scale=0.02)
        rows = moe.tile_rows(entries, EXPERTS)
        ints = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device="cuda")  # noqa: E731
        self.kept = [ints(tokens, TOP_K), torch.zeros(tokens, TOP_K, device="cuda"), ints(EXPERTS + 1),
                     ints(entries), ints(entries), ints(moe.max_tiles(entries, EXPERTS, rows), 2), ints(1)]
        self.routed = moe.Routed(*(D.from_torch(t) for t in self.kept), rows)
        self.done = ints(1)
        self.activated = torch.empty(entries, WIDTH, dtype=torch.bfloat16, device="cuda")
        self.expert_out = torch.empty(entries, HIDDEN, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()            # the kernels run on another stream than torch's fills

    def launches(self, lib, stream) -> dict:
        """The layer's parts, each a zero-argument launch: routing, the first GEMM with the activation, the second
        GEMM, the combine."""
        from metrale.runtime.backend.cuda.kernels import moe
        from metrale.runtime.backend.cuda.tensor import DeviceTensor as D
        r = self.routed
        return {"routing": lambda: moe.route(lib, stream, r, D.from_torch(self.logits), TOP_K, True, True, None, 1, 1,
                                             1.0, D.from_torch(self.done)),
                "up GEMM": lambda: moe.grouped_gemm(lib, stream, D.from_torch(self.activated), D.from_torch(self.x),
                                                    D.from_torch(self.up), r, TOP_K, gated=True),
                "down GEMM": lambda: moe.grouped_gemm(lib, stream, D.from_torch(self.expert_out),
                                                      D.from_torch(self.activated), D.from_torch(self.down), r, 0),
                "combine": lambda: moe.combine(lib, stream, D.from_torch(self.out), D.from_torch(self.expert_out), r)}

    def experts_hit(self) -> int:
        offsets = self.kept[2].cpu()
        return int(((offsets[1:] - offsets[:-1]) > 0).sum())


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_variant_option(parser, "moe.cu")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens a case, comma-separated")
    args = parser.parse_args(argv)
    device, libraries = bench_libraries("moe", args.variant)
    stream = device.stream
    print(gpu_machine_line("gpu_moe_kernels", "cuda"))
    bandwidth, rate = copy_bandwidth("cuda", 2 * 10**9), gemm_rate("cuda", 8192)
    expert = 2 * 3 * WIDTH * HIDDEN
    print(f"# {EXPERTS} experts of {HIDDEN} x {WIDTH}, top-{TOP_K}: {expert / 1e6:.2f} MB an expert; copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s, bf16 GEMM {rate / 1e12:.1f} TFLOP/s; us a layer, x: the GEMMs' experts "
          f"bytes / time / copy bandwidth (decode) or FLOPs / time / GEMM rate (prefill)")
    print(f"{'tokens':>6} {'variant':<10} {'experts':>7} {'routing':>8} {'up GEMM':>8} {'down GEMM':>9} "
          f"{'combine':>8} {'x':>5} {'diff':>9}")
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        layer, reference = Layer(tokens), None
        for variant, lib in libraries.items():
            parts = layer.launches(lib, stream)
            for launch in parts.values():
                launch()
            stream.sync()
            got = layer.out.float()
            reference = got if reference is None else reference
            diff = relative_diff(got, reference)
            us = {name: time_launch_us(stream, launch, LAUNCHES) for name, launch in parts.items()}
            hit = layer.experts_hit()
            gemms_s = (us["up GEMM"] + us["down GEMM"]) / 1e6
            decode = tokens * TOP_K <= 16 * EXPERTS
            fraction = (hit * expert / gemms_s / bandwidth if decode
                        else 2 * tokens * TOP_K * 3 * WIDTH * HIDDEN / gemms_s / rate)
            results.append({"tokens": tokens, "variant": variant, "experts_hit": hit, "us": us,
                            "fraction": fraction, "diff": diff})
            print(f"{tokens:6d} {variant:<10} {hit:7d} {us['routing']:8.1f} {us['up GEMM']:8.1f} "
                  f"{us['down GEMM']:9.1f} {us['combine']:8.1f} {fraction:5.2f} {diff:9.2e}", flush=True)
        del layer
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
