"""A tensor-parallel worker's other ranks: each holds its shard of the model and of the cache and runs rank 0's
calls (leader.py) as they come, each on rank 0's caller's stream, until rank 0 stops it. It answers nothing: rank 0
samples from the gathered logits. A call whose part here fails is reported to rank 0, whose wait on the device for
that part it ends."""

import structlog

from metrale.runtime.parallel.leader import RENEW, STOP

log = structlog.get_logger()

# The calls whose collectives meet rank 0's: one that fails here fails there too, and the ranks carry on together.
COLLECTIVE_CALLS = ("warm_up", "forward", "encode")


def follow(group, model, runner, specs: tuple) -> None:
    """specs: the model's cache specs as rank 0's (build.py's with_kv_dtype)."""
    layers, failed = None, False
    if hasattr(runner, "bound_waits"):      # a device that works ahead: a wait on it ends where rank 0 renews
        runner.bound_waits(group.timeout.total_seconds() / 2, group.renewing)

    def forward(batch):
        return model.forward(batch, layers)

    def encode(batch):
        model.encode(batch, layers)

    calls = {"allocate_cache": lambda *args: runner.allocate_cache(specs, *args),
             "warm_up": lambda *args: runner.warm_up(forward, *args),
             "forward": lambda *args: runner.run_forward(forward, *args),
             "encode": lambda *args: runner.run_encoder(encode, *args),
             "copy_blocks": lambda *args: runner.copy_block_prefixes(layers, *args),
             "copy_states": lambda *args: runner.copy_state_slots(layers, *args)}
    while (message := group.receive()) != STOP:
        if message == RENEW:            # after a call that failed partway, on any rank
            group.renew_collectives()
            failed = False
            continue
        call, stream, *args = message
        if call not in calls:
            raise ValueError(f"rank 0 sent an unknown call {call!r}")
        if failed and call in COLLECTIVE_CALLS:
            # Another stream's call, sent before rank 0 knew: its collectives would pair with the failed call's
            # rest on rank 0. Rank 0 fails it too (its collectives are renewed under it).
            continue
        try:
            runner.bind_stream(stream)
            result = calls[call](*args)
        except Exception:
            if call not in COLLECTIVE_CALLS:
                raise                   # this rank's shard would differ from rank 0's: it ends (RankLost there)
            # Rank 0's call fails too, its collectives broken off (at once, or at its next call's; on the device at
            # its watch's word), and it sends RENEW.
            log.warning("tensor_parallel_call_failed", call=call, rank=group.shard.rank, exc_info=True)
            if not group.renewing():    # rank 0's renewal ended the wait: nothing to tell it
                group.report_failure()
            group.drop_collectives()
            failed = True
            continue
        if call == "allocate_cache":
            layers = result
