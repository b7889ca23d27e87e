"""The prefill cases of bench/gpu_decode.py: prompts NUMxLEN timed on the engine and the peer against the GEMM
rate, and one long prompt whole against in the worker's chunks."""

from bench.decode_tables import PrefillRow
from bench.grpc_client import prefill_round_trips_in_subprocess
from bench.model_shapes import prefill_flops, random_tokens
from bench.phases import Run
from bench.side_by_side import time_peer_prefill


def parse_prefill_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for case in filter(None, (c.strip() for c in text.split(","))):
        n, length = case.lower().split("x")
        cases.append((int(n), int(length)))
    return cases


def measure_prefill(run: Run, args, shape, cases, gemm: float, ours, peer, device: str,
                    worker=None) -> list[PrefillRow]:
    """One prefill of every case on the engine, through gRPC (with a worker: a client process's Prefill round
    trip), then on the peer: model FLOP/s against the GEMM rate."""
    rows: list[PrefillRow] = []
    for n, length in cases:
        tokens = random_tokens(n, length, shape.vocab, args.seed + 2)
        flops = prefill_flops(shape, n, length)

        def timed(impl: str, time_it, *inputs) -> PrefillRow:
            row = PrefillRow(n, length, impl, flops, gemm)
            times, row.note = run.phase(f"prefill {n}x{length} {impl}", time_it, *inputs, args.prefill_warmup,
                                        args.prefill_reps)
            row.step_ms = times or []
            return row
        rows.append(timed("metrale", ours.time_prefill, tokens) if ours
                    else PrefillRow(n, length, "metrale", flops, gemm, note="no engine"))
        if worker:
            rows.append(timed("grpc", prefill_round_trips_in_subprocess, worker.address, tokens.tolist()))
        if peer:
            rows.append(timed("peer", time_peer_prefill, peer, tokens.to(device)))
    return rows


def p50(times: list[float] | None) -> float | None:
    return sorted(times)[len(times) // 2] if times else None


def parse_chunked_prefill(spec: str) -> tuple[int, int]:
    """'LENxCHUNK' -> (LEN, CHUNK), both > 0; '' -> (0, 0)."""
    if not spec:
        return 0, 0
    try:
        long_len, chunk = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--chunked-prefill {spec!r}: expected LENxCHUNK, e.g. 32768x2048") from None
    if long_len <= 0 or chunk <= 0:
        raise SystemExit(f"--chunked-prefill {spec!r}: LEN and CHUNK must be > 0")
    return long_len, chunk


def measure_chunked_prefill(run: Run, args, shape, long_len: int, chunk: int, ours, worker=None) -> dict:
    """p50 ms of one prompt of long_len tokens prefilled whole, then in chunks of `chunk` (one step each), on the
    engine ("whole", "chunked") and, with a worker, through gRPC ("grpc whole", "grpc chunked")."""
    tokens = random_tokens(1, long_len, shape.vocab, args.seed + 4)
    chunked = {}
    for name, size in (("whole", 0), ("chunked", chunk)):
        times, _ = run.phase(f"prefill {long_len} {name}", ours.time_prefill, tokens, args.prefill_warmup,
                             args.prefill_reps, size)
        chunked[name] = p50(times)
        if worker:
            times, _ = run.phase(f"prefill {long_len} {name} grpc", prefill_round_trips_in_subprocess,
                                 worker.address, tokens.tolist(), args.prefill_warmup, args.prefill_reps, size)
            chunked[f"grpc {name}"] = p50(times)
    return chunked
