"""The prefix cache end to end through gRPC: N requests sharing a system prompt, each with its own question, prefilled
as one Prefill once the system prompt is cached, with --prefix-cache on against off in the same run (the two
workers taking turns): time to first token of the batch, prompt tokens computed, and the decode step after it.

Run from the repository root:
  python -m bench.prefix_cache                       (CPU: the embedded default model, 8 x (256 + 16) tokens)
  python -m bench.prefix_cache --device cuda --shape llama3-8b --requests 64 --system 4096 --question 64
  python -m bench.prefix_cache --device cuda --shape nemotron-h-8b --requests 16 --system 4096 --question 64 \
      --max-seqs 32                                  (a hybrid: prefill resumes from the SSM snapshot)
"""

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from bench.grpc_overhead import loopback_config, machine_line, quiet_logs
from bench.model_shapes import HYBRID_SHAPES, SHAPES, random_checkpoint
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.config import EngineConfig
from metrale.runtime.default_model import default_cache_dir, fetch_default_model
from metrale.runtime.loading import load_checkpoint
from metrale.service.in_process import InProcessWorker
from metrale.service.server import WorkerServer
from metrale.v1 import worker_pb2 as pb


@dataclass
class Row:
    cache: str                                              # "on" or "off"
    ttft_ms: list[float] = field(default_factory=list)      # the batch's Prefill call, per rep
    computed: list[int] = field(default_factory=list)       # prompt tokens computed (not served), per rep
    decode_ms: list[float] = field(default_factory=list)    # Decode calls of the whole batch after it

    @property
    def summary(self) -> dict:
        return {"cache": self.cache, "ttft_ms": statistics.median(self.ttft_ms),
                "computed_tokens": statistics.median(self.computed), "decode_ms": statistics.median(self.decode_ms)}


def tokens(rng: torch.Generator, count: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (count,), generator=rng).tolist()


def run_rep(stub, rep: int, system: list[int], args, vocab: int, row: Row) -> None:
    """A warm-up request caches the system prompt (where the cache is on), then the batch: one Prefill of every
    request, then decode steps of all of them."""
    rng = torch.Generator().manual_seed(1000 + rep)
    base = 1_000_000 * (rep + 1)
    stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=base, tokens=system + tokens(rng, 1, vocab),
                                                           is_last_chunk=True)]))
    # The k-th chunks of every slice run as one forward: chunks that keep a forward within max_batch_tokens.
    chunk = args.max_batch_tokens // args.requests
    slices = [pb.PrefillSlice(seq_id=base + 1 + i, tokens=system + tokens(rng, args.question, vocab),
                              is_last_chunk=True, chunk_size=chunk) for i in range(args.requests)]
    started = time.perf_counter()
    out = stub.Prefill(pb.PrefillRequest(slices=slices))
    row.ttft_ms.append((time.perf_counter() - started) * 1e3)
    row.computed.append(sum(len(s.tokens) for s in slices) - sum(out.cached_tokens))
    seq_ids, next_tokens = list(out.seq_ids), list(out.tokens)
    for _ in range(args.decode_steps):
        started = time.perf_counter()
        out = stub.Decode(pb.DecodeRequest(seq_ids=seq_ids, tokens=next_tokens))
        row.decode_ms.append((time.perf_counter() - started) * 1e3)
        next_tokens = list(out.tokens)
    stub.Release(pb.ReleaseRequest(all=True))


def format_table(rows: list[Row]) -> str:
    on, off = (next(r.summary for r in rows if r.cache == mode) for mode in ("on", "off"))
    lines = [f"{'cache':<5}  {'TTFT ms':>9}  {'tokens computed':>15}  {'decode ms':>9}"]
    lines += [f"{s['cache']:<5}  {s['ttft_ms']:>9.1f}  {s['computed_tokens']:>15.0f}  {s['decode_ms']:>9.2f}"
              for s in (on, off)]
    lines.append(f"off/on: TTFT {off['ttft_ms'] / on['ttft_ms']:.1f}x, tokens computed "
                 f"{off['computed_tokens'] / on['computed_tokens']:.1f}x, decode {off['decode_ms'] / on['decode_ms']:.3f}")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory; default: the embedded model")
    parser.add_argument("--shape", choices=sorted(SHAPES | HYBRID_SHAPES), default=None,
                        help="random weights of this shape")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system", type=int, default=256, help="tokens of the shared system prompt")
    parser.add_argument("--question", type=int, default=16, help="tokens of each request's own question")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=16384, help="the workers' limit per forward")
    parser.add_argument("--reps", type=int, default=3, help="reps of each mode, taking turns")
    parser.add_argument("--max-seqs", type=int, default=512, help="the workers' max_seqs (a hybrid's state slots "
                                                                  "follow it)")
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(machine_line("prefix_cache"))
    checkpoint = (random_checkpoint((SHAPES | HYBRID_SHAPES)[args.shape], 0, args.device) if args.shape
                  else load_checkpoint(args.model or fetch_default_model(default_cache_dir())))
    longest = args.system + max(args.question, 1) + args.decode_steps + 1
    blocks = (args.requests + 2) * blocks_for(longest, EngineConfig.kv_block_size) + 16
    workers = {mode: InProcessWorker(lambda on=(mode == "on"): WorkerServer.from_checkpoint(
        checkpoint, loopback_config(EngineConfig(device=args.device, prefix_cache=on, kv_blocks=blocks,
                                                 max_model_len=longest, max_seqs=max(args.max_seqs, args.requests),
                                                 max_batch_tokens=args.max_batch_tokens))))
               for mode in ("on", "off")}
    rows = [Row(mode) for mode in workers]
    try:
        info = workers["on"].stub.Info(pb.InfoRequest())
        system = tokens(torch.Generator().manual_seed(7), args.system, info.vocab_size)
        print(f"# {info.model_id}: {info.architecture} {info.dtype} on {info.device}; {args.requests} requests of "
              f"{args.system} shared + {args.question} own tokens, {args.decode_steps} decode steps, {args.reps} "
              f"reps a mode, taking turns; kv_block_size {info.kv_block_size}")
        for rep in range(args.reps + 1):            # rep 0 warms both workers up and is not counted
            for row in rows:
                counted = Row(row.cache)
                run_rep(workers[row.cache].stub, rep, system, args, info.vocab_size, counted)
                if rep:
                    row.ttft_ms += counted.ttft_ms
                    row.computed += counted.computed
                    row.decode_ms += counted.decode_ms
    finally:
        for worker in workers.values():
            worker.stop()
    print(format_table(rows))
    result = {"args": vars(args), "rows": [asdict(r) | r.summary for r in rows]}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return result


if __name__ == "__main__":
    quiet_logs()
    main()
