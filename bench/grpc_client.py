"""A gateway's decode loop through gRPC, run in a process of its own (so the client does not share the worker's
interpreter lock): prefill `batch` prompts, then decode, each step fed the tokens of the last, timed per round
trip on the client; each step a unary Decode, or a message on one open Steps stream. Used by bench/gpu_decode.py;
run alone it prints JSON.

python3 -m bench.grpc_client ADDRESS --batch 1 --context 1024 --steps 32 --warmup 5 --vocab 128256 [--rpc steps]
"""

import argparse
import json
import multiprocessing
import queue
import time

import grpc
import torch

from metrale.service.in_process import CLIENT_OPTIONS
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc


def decode_round_trips(address: str, batch: int, context: int, steps: int, warmup: int, vocab: int,
                       seed: int = 0, first_seq_id: int = 1 << 40, breakdown: list | None = None,
                       rpc: str = "unary") -> list[float]:
    """ms per Decode round trip for the timed steps; the sequences are released at the end. rpc: "unary" (a
    Decode call a step) or "steps" (a StepRequest a step on one Steps stream, as a gateway keeps open). breakdown,
    if given, receives (round trip ms, the worker's forward_us / 1e3, its queue_us / 1e3) per timed step."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, context), generator=generator).tolist()
    ids = list(range(first_seq_id, first_seq_id + batch))
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        tokens = {}
        per_request = max(1, 8192 // context)
        for start in range(0, batch, per_request):
            slices = [pb.PrefillSlice(seq_id=i, tokens=p, is_last_chunk=True)
                      for i, p in zip(ids[start:start + per_request], prompts[start:start + per_request])]
            response = stub.Prefill(pb.PrefillRequest(slices=slices))
            tokens.update(zip(response.seq_ids, response.tokens))
        times = []
        decode = stub.Decode if rpc == "unary" else StepStream(stub)
        try:
            for step in range(warmup + steps):
                request = pb.DecodeRequest(seq_ids=ids, tokens=[tokens[i] for i in ids])
                started = time.perf_counter()
                response = decode(request)
                elapsed = (time.perf_counter() - started) * 1e3
                tokens = dict(zip(response.seq_ids, response.tokens))
                if step >= warmup:
                    times.append(elapsed)
                    if breakdown is not None:
                        breakdown.append((elapsed, response.forward_us / 1e3, response.queue_us / 1e3))
        finally:
            if rpc == "steps":
                decode.close()
            stub.Release(pb.ReleaseRequest(seq_ids=ids))
    return times


class StepStream:
    """One open Steps stream, called like stub.Decode: each call sends a step and waits for its answer."""

    def __init__(self, stub):
        self.requests = queue.SimpleQueue()
        self.responses = stub.Steps(iter(self.requests.get, None))
        self.step_id = 0

    def __call__(self, request: pb.DecodeRequest) -> pb.ForwardResponse:
        self.step_id += 1
        self.requests.put(pb.StepRequest(step_id=self.step_id, decode=request))
        answer = next(self.responses)
        if answer.HasField("error"):
            raise RuntimeError(f"step {answer.step_id} failed: {answer.error.message}")
        if answer.step_id != self.step_id:
            raise RuntimeError(f"the answer to step {self.step_id} came as step {answer.step_id}")
        return answer.result

    def close(self) -> None:
        self.requests.put(None)
        for _ in self.responses:     # the stream ends once the worker has seen the end of the requests
            pass


def prefill_round_trips(address: str, prompts: list[list[int]], warmup: int, reps: int, chunk_size: int = 0,
                        first_seq_id: int = 1 << 41) -> list[float]:
    """ms per Prefill round trip of all `prompts` in one request (chunk_size > 0: the worker runs each in chunks of
    that many tokens), as a gateway sees its time to first token; the sequences are released after each."""
    times = []
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for rep in range(warmup + reps):
            ids = [first_seq_id + rep * len(prompts) + i for i in range(len(prompts))]
            request = pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=i, tokens=p, is_last_chunk=True,
                                                                chunk_size=chunk_size)
                                                for i, p in zip(ids, prompts)])
            started = time.perf_counter()
            stub.Prefill(request)
            elapsed = (time.perf_counter() - started) * 1e3
            stub.Release(pb.ReleaseRequest(seq_ids=ids))
            if rep >= warmup:
                times.append(elapsed)
    return times


def prefill_round_trips_in_subprocess(address: str, prompts: list[list[int]], warmup: int, reps: int,
                                      chunk_size: int = 0, timeout: float = 300.0) -> list[float]:
    """prefill_round_trips in a fresh (spawned) process."""
    return run_spawned(prefill_round_trips, (address, prompts, warmup, reps, chunk_size), timeout,
                       "the gRPC prefill client")


def _breakdown(args, rpc) -> list[tuple]:
    breakdown = []
    decode_round_trips(*args, breakdown=breakdown, rpc=rpc)
    return breakdown


def _spawned(results, target, args) -> None:
    try:
        results.put(("ok", target(*args)))
    except Exception as error:   # reported to the parent, which raises
        results.put(("error", repr(error)))


def run_spawned(target, args: tuple, timeout: float, what: str):
    """target(*args) in a fresh (spawned) process, a client of the worker in a process of its own: its result, or
    RuntimeError naming `what` with the child's error."""
    context_ = multiprocessing.get_context("spawn")
    results = context_.Queue()
    process = context_.Process(target=_spawned, args=(results, target, args))
    process.start()
    try:
        status, value = results.get(timeout=timeout)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    if status != "ok":
        raise RuntimeError(f"{what} failed: {value}")
    return value


def decode_round_trips_in_subprocess(address: str, batch: int, context: int, steps: int, warmup: int,
                                     vocab: int, seed: int = 0, timeout: float = 300.0, rpc: str = "unary"
                                     ) -> list[tuple]:
    """decode_round_trips in a fresh (spawned) process: (round trip, forward, queue) ms per timed step."""
    return run_spawned(_breakdown, ((address, batch, context, steps, warmup, vocab, seed), rpc), timeout,
                       "the gRPC client")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--rpc", default="unary", choices=("unary", "steps"))
    args = parser.parse_args()
    print(json.dumps(decode_round_trips(args.address, args.batch, args.context, args.steps, args.warmup,
                                        args.vocab, rpc=args.rpc)))


if __name__ == "__main__":
    main()
