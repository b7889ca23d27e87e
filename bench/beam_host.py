"""The host's share of a BeamGenerate step, without a model: the beam loop of `runtime/beam/` (search, block
bookkeeping, the step's batch) and the CUDA backend's packing of the step's metadata (`pack_batch`, the decoder's
batch and its cross batch), against a model that answers at once with random candidates. What is left of a step's
time on a GPU, less this, is the device's and the copies'.

python -m bench.beam_host --batches 1,16,64     (NLLB's shape: 32-token sources, 4 beams, 32 new tokens)
"""

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from bench.grpc_overhead import machine_line
from bench.phases import host_profile, log
from metrale.runtime.backend.cuda.batch import metadata_elements, pack_batch
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.beam.candidates import HostCandidates
from metrale.runtime.beam.params import BeamParams, BeamRequest
from metrale.runtime.beam.call import BeamCall, BeamModel
from metrale.runtime.cache.blocks import BlockPool
from metrale.runtime.planner import Limits

VOCAB, EOS, PAD, START, BLOCK, MAX_LEN = 256206, 2, 1, 2, 16, 1024


@dataclass
class Row:
    batch: int
    step_ms: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.step_ms)


class InstantModel:
    """A BeamModel's forward and encode that pack the batch as the CUDA backend does, then answer random
    candidates, best first."""

    def __init__(self, max_seqs: int):
        max_blocks = MAX_LEN // BLOCK
        self.region = DeviceTensor(0, (metadata_elements(8192, max_seqs, max_blocks),), "int32")
        self.max_blocks, self.generator = max_blocks, torch.Generator().manual_seed(0)

    def forward(self, batch, banned, count):
        pack_batch(batch, self.region, self.max_blocks)
        if batch.cross is not None:
            pack_batch(batch.cross, self.region, self.max_blocks)
        n = len(batch.sample_rows)
        values = -torch.rand(n, count, generator=self.generator).sort(dim=1, descending=True).values * 10 - 1
        return HostCandidates(values, torch.randint(3, VOCAB, (n, count), generator=self.generator))

    def encode(self, segments):
        pass

    def beam_model(self) -> BeamModel:
        return BeamModel(self.forward, lambda copies: None, (EOS,), PAD, VOCAB, self.encode, START)


def run_call(requests, model: BeamModel) -> None:
    call = BeamCall(requests, Limits(MAX_LEN, 8192, BLOCK, 512, START, MAX_LEN), BLOCK, model)
    needed = call.blocks_needed()
    call.run(BlockPool(needed, BLOCK, list(range(needed))), lambda: False)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--source-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N functions of one call per batch")
    args = parser.parse_args(argv)
    print(machine_line("beam_host"), flush=True)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        params = BeamParams(num_beams=args.beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        requests = [BeamRequest(i, src_tokens=tuple(range(4, 4 + args.source_len)), decoder_prefix=(VOCAB - 1,),
                                params=params) for i in range(batch)]
        model = InstantModel(batch * args.beams).beam_model()
        run_call(requests, model)      # warm-up
        times = []
        for _ in range(args.reps):
            started = time.perf_counter()
            run_call(requests, model)
            times.append((time.perf_counter() - started) * 1e3 / args.new_tokens)
        rows.append(Row(batch, times))
        if args.profile:
            log(f"profile, batch {batch}:\n" + host_profile(lambda: run_call(requests, model), args.profile))
    print(f"# beam_host: {args.source_len}-token sources, {args.beams} beams, {args.new_tokens} new tokens, "
          f"vocabulary {VOCAB}; p50 of {args.reps} calls after a warm-up")
    print(f"{'requests':>8}  {'beams':>5}  {'host ms a step':>14}")
    for r in rows:
        print(f"{r.batch:>8}  {r.batch * args.beams:>5}  {r.p50:>14.3f}")
    return rows


if __name__ == "__main__":
    main()
