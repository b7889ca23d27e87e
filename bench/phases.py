"""A benchmark run as a sequence of phases, each timed and caught, under a time budget (bench/gpu_decode.py); the
benches' log line and host profile."""

import cProfile
import datetime
import io
import pstats
import time
import traceback

import torch


class Run:
    """Phases in order, each caught: a failure is printed and noted in its rows, and the run goes on; a phase
    that would start past the time budget is skipped, so the table still prints before an outer time limit."""

    def __init__(self, budget_s: float, device: str):
        self.started = time.perf_counter()
        self.budget_s = budget_s
        self.device = device
        self.phases: dict[str, float] = {}
        self.errors: list[str] = []
        self.peak_bytes_in_use = 0    # device memory in use (torch's and the engine's), highest at a phase's end

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def summary(self) -> str:
        """The closing line of a bench's tables: the run's time, each phase's, and what failed."""
        phases = ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items())
        errors = f"; ERRORS: {self.errors}" if self.errors else ""
        return f"# total {self.elapsed():.0f} s; phases (s): {phases}{errors}"

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def phase(self, name: str, fn, *args):
        """fn(*args), timed; returns (result, note): note is '' or why there is no result."""
        if self.over_budget():
            log(f"skipped {name}: {self.elapsed():.0f} s passed the time budget of {self.budget_s:.0f} s")
            return None, "skipped: time budget"
        started = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as error:
            traceback.print_exc()
            note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
            self.errors.append(f"{name}: {note}")
            log(f"{name} {note}")
            return None, note
        finally:
            self.phases[name] = time.perf_counter() - started
            if torch.device(self.device).type == "cuda":
                free, total = torch.cuda.mem_get_info()
                self.peak_bytes_in_use = max(self.peak_bytes_in_use, total - free)
        log(f"{name}: {self.phases[name]:.1f} s")
        return result, ""


def log(message: str) -> None:
    print(f"# [{datetime.datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def host_profile(call, rows: int, sort: str = "tottime") -> str:
    """call() under cProfile: the `rows` host functions with the most own time (or cumulative: with their callees),
    as pstats prints them."""
    profiler = cProfile.Profile()
    profiler.runcall(call)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(rows)
    text = out.getvalue()
    return text[text.find("ncalls"):].rstrip()


def add_decode_options(parser, shapes, shape: str, batches: str, steps: int, warmup: int, context: bool = True
                       ) -> None:
    """The options every decode bench takes: the model shape (one of shapes, random weights), the device, the batch
    sizes, the context each sequence holds (where the bench takes one), the timed and untimed steps."""
    parser.add_argument("--shape", default=shape, choices=sorted(shapes), help="model shape (random weights)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke test's path")
    parser.add_argument("--batches", default=batches, help="decode batch sizes, comma-separated")
    if context:
        parser.add_argument("--context", type=int, default=1024, help="tokens each sequence holds before decoding")
    parser.add_argument("--steps", type=int, default=steps, help="timed decode steps per batch (and implementation)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed decode steps first (a peer's: compile, "
                                                                   "graphs)")


def add_run_options(parser, time_budget: float = 540.0) -> None:
    """The options a GPU bench's run takes beside its own: the ceilings' sizes, gRPC off, the seed, the time
    budget, the JSON file."""
    parser.add_argument("--copy-mb", type=int, default=4096, help="bytes copied to measure copy bandwidth (MB)")
    parser.add_argument("--gemm-size", type=int, default=8192, help="n of the n^3 bf16 GEMM for the GEMM rate")
    parser.add_argument("--skip-grpc", action="store_true", help="no decode through gRPC")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=time_budget,
                        help="seconds after which no new phase starts (the tables still print)")
    parser.add_argument("--json", default=None, help="write every number here")
