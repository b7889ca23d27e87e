"""The engine side of bench/gpu_decode.py and bench/gpu_profile.py: prefill, decode and time steps through the
engine's Step API, as a gateway would, with the backend's device-time events where it has them."""

import time

import torch

from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step


class EngineRunner:
    """Steps the engine through its Step API. Engine.step is synchronous (it copies the sampled tokens or logits
    to the host), so the host clock around it is the step's time, host work included."""

    def __init__(self, engine, max_batch_tokens: int):
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.next_seq_id = 0
        self.runner = engine.runner
        if hasattr(self.runner, "time_steps"):
            self.runner.time_steps(True)

    def new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_seq_id, self.next_seq_id + n))
        self.next_seq_id += n
        return ids

    def prefill(self, tokens: torch.Tensor) -> dict[int, int]:
        """Prefills each row of tokens [n, T] as a new sequence, as many per step as max_batch_tokens allows
        (a prompt longer than that in chunks); returns seq_id -> sampled next token."""
        n, length = tokens.shape
        per_step = max(1, self.max_batch_tokens // length)
        chunk = 0 if length <= self.max_batch_tokens else self.max_batch_tokens
        next_tokens = {}
        rows = list(zip(self.new_ids(n), tokens.tolist()))
        for start in range(0, n, per_step):
            slices = tuple(PrefillSlice(seq_id, tuple(row), chunk_size=chunk) for seq_id, row in
                           rows[start:start + per_step])
            out = self.engine.step(Step(prefill=slices))
            next_tokens.update({o.seq_id: o.token for o in out.outputs})
        return next_tokens

    def time_decode(self, next_tokens: dict[int, int], warmup: int, steps: int) -> tuple[list[float], list[float]]:
        """warmup untimed, then `steps` timed decode steps of every sequence; returns (device ms, host ms) per
        step: the backend's events from the forward's launch to the end of sampling where it has them (else the
        engine's forward_us), and the host clock around Engine.step."""
        device_ms, host_ms = [], []
        for i in range(warmup + steps):
            step = Step(decode=tuple(DecodeToken(seq_id, token) for seq_id, token in next_tokens.items()))
            started = time.perf_counter()
            out = self.engine.step(step)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            next_tokens = {o.seq_id: o.token for o in out.outputs}
            if i >= warmup:
                host_ms.append(elapsed_ms)
                device = self.runner.last_device_ms() if hasattr(self.runner, "last_device_ms") else None
                device_ms.append(device if device is not None else out.forward_us / 1e3)
        return device_ms, host_ms

    def time_prefill(self, tokens: torch.Tensor, warmup: int, reps: int, chunk_size: int = 0) -> list[float]:
        """One step prefilling every row of tokens [n, T] (n x T <= max_batch_tokens: one forward; with chunk_size,
        the worker's chunks of it one forward after another), released after each; returns the timed steps' ms."""
        times = []
        for i in range(warmup + reps):
            ids = self.new_ids(tokens.shape[0])
            step = Step(prefill=tuple(PrefillSlice(seq_id, tuple(row), chunk_size=chunk_size)
                                      for seq_id, row in zip(ids, tokens.tolist())))
            started = time.perf_counter()
            self.engine.step(step)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            self.engine.release(ids)
            if i >= warmup:
                times.append(elapsed_ms)
        return times

    def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits of each prompt's last token (prompts released after)."""
        ids = self.new_ids(tokens.shape[0])
        step = Step(prefill=tuple(PrefillSlice(seq_id, tuple(row), output=OutputOptions(return_logits=True))
                                  for seq_id, row in zip(ids, tokens.tolist())))
        out = self.engine.step(step)
        self.engine.release(ids)
        by_id = {o.seq_id: o.logits for o in out.outputs}
        return torch.stack([by_id[i].float() for i in ids])

    def release_all(self) -> None:
        self.engine.release(None)
