"""One rank of a tensor-parallel engine on the CPU backend, for the tests: builds its shard of a checkpoint in a gloo
group; rank 0 runs steps() on its engine and saves what it saw, the others follow its calls.

python tests/tensor_parallel_rank.py CHECKPOINT RANK SIZE PORT OUT [DIE_AFTER] [kv_dtype=KV_DTYPE] [fail=N]

DIE_AFTER: the other ranks exit, as a crash would, at rank 0's DIE_AFTER-th message; rank 0 then saves the error its
step raised. KV_DTYPE: the engine's kv_dtype (CONFIG's otherwise). fail=N: rank 1's model raises in its N-th forward
(once), partway through; rank 0 runs the step that failed again, and saves the error's type."""

import os
import sys
from dataclasses import replace

import torch

from metrale.runtime.build import build_engine, build_follower
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import StepFailed
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step

NUM_DECODES = 8
CONFIG = EngineConfig(device="cpu", kv_blocks=32, kv_block_size=4)


def steps(engine, failures: list | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Two sequences: one prompt in one chunk, another in two chunks beside it (an encoder-decoder's two sources,
    each whole), then greedy decode steps of both; the tokens chosen and every step's logits rows. failures: a step
    that fails (StepFailed) is run again, once, and its error's type appended here."""
    def step(request):
        try:
            return engine.step(request)
        except StepFailed as error:
            if failures is None:
                raise
            failures.append(type(error).__name__)
            return engine.step(request)

    logits_out = OutputOptions(return_logits=True)
    first, second = tuple(range(3, 23)), tuple(range(40, 53))
    if getattr(engine.model.config, "is_encoder_decoder", False):     # sources come whole (the encoder's), two in one step
        outputs = step(Step(prefill=(PrefillSlice(1, first, output=logits_out),
                                            PrefillSlice(2, second, output=logits_out)))).outputs
    else:
        outputs = step(Step(prefill=(PrefillSlice(1, first, output=logits_out),
                                            PrefillSlice(2, second[:6], is_last_chunk=False,
                                                         output=logits_out)))).outputs
        outputs += step(Step(prefill=(PrefillSlice(2, second[6:], chunk_start=6),))).outputs
    tokens, logits = [o.token for o in outputs], [o.logits for o in outputs]
    last = {1: tokens[0], 2: tokens[1]}
    for _ in range(NUM_DECODES):
        outputs = step(Step(decode=tuple(DecodeToken(seq, token) for seq, token in last.items()))).outputs
        last = {seq: o.token for seq, o in zip(last, outputs)}
        tokens += [o.token for o in outputs]
        logits += [o.logits for o in outputs]
    return tokens, logits


class DyingGroup:
    """A follower's group that ends the process at the die_after-th message, before running it."""

    def __init__(self, group, die_after: int):
        self.group, self.left = group, die_after

    def __getattr__(self, name):
        return getattr(self.group, name)

    def receive(self):
        self.left -= 1
        if self.left < 0:
            os._exit(3)
        return self.group.receive()


def main(checkpoint: str, rank: int, size: int, port: int, out: str, die_after: int | None = None,
         kv_dtype: str = CONFIG.kv_dtype, fail: str | None = None) -> None:
    from metrale.runtime.parallel.group import GlooGroup, Shard

    from metrale.runtime.parallel.follower import follow

    config = replace(CONFIG, kv_dtype=kv_dtype)
    group = GlooGroup(Shard(rank, size), f"127.0.0.1:{port}", timeout_s=60)
    if rank == 0:
        engine, _ = build_engine(load_checkpoint(checkpoint), config, group=group)
        failures = []
        try:
            tokens, logits = steps(engine, failures if fail else None)
        except Exception as error:
            torch.save({"error": f"{type(error).__name__}: {error}"}, out)
            os._exit(0)         # the group cannot close without the dead rank
        engine.runner.stop()            # the other ranks' loops end, and this rank leaves the group
        torch.save({"tokens": tokens, "logits": logits, "failures": failures}, out)
    else:
        follower = group if die_after is None else DyingGroup(group, die_after)
        model, *rest = build_follower(load_checkpoint(checkpoint), config, group)
        if fail and rank == 1:
            model.forward = failing_once(model, int(fail))
        follow(follower, model, *rest)
        group.close()


def failing_once(model, n: int):
    """model.forward, raising in its n-th call after its first layer's collectives (partway, as a bug would)."""
    calls, forward, all_reduce = [], model.forward, model.math.all_reduce

    def reduce_then_fail(x):
        model.math.all_reduce = all_reduce
        all_reduce(x)
        raise RuntimeError("injected in rank 1's forward")

    def wrapped(batch, layers):
        calls.append(1)
        if len(calls) == n:
            model.math.all_reduce = reduce_then_fail
        return forward(batch, layers)
    return wrapped


if __name__ == "__main__":
    options = dict(arg.split("=", 1) for arg in sys.argv[6:] if "=" in arg)
    die = [int(arg) for arg in sys.argv[6:] if "=" not in arg]
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], die[0] if die else None,
         **options)
