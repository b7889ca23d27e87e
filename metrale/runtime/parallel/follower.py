"""A tensor-parallel worker's other ranks: each holds its shard of the model and of the cache and runs rank 0's
calls (leader.py) as they come, until rank 0 stops it. It answers nothing: rank 0 samples from the gathered logits."""

from metrale.runtime.parallel.leader import STOP


def follow(group, model, runner, specs: tuple) -> None:
    """specs: the model's cache specs as rank 0's (build.py's with_kv_dtype)."""
    layers = None

    def forward(batch):
        return model.forward(batch, layers)

    def encode(batch):
        model.encode(batch, layers)

    while (message := group.receive()) != STOP:
        call, *args = message
        if call == "allocate_cache":
            layers = runner.allocate_cache(specs, *args)
        elif call == "warm_up":
            runner.warm_up(forward, *args)
        elif call == "forward":
            runner.run_forward(forward, *args)
        elif call == "encode":
            runner.run_encoder(encode, *args)
        elif call == "copy_blocks":
            runner.copy_block_prefixes(layers, *args)
        elif call == "copy_states":
            runner.copy_state_slots(layers, *args)
        else:
            raise ValueError(f"rank 0 sent an unknown call {call!r}")
