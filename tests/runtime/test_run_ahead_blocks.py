"""Run-ahead and the KV pool: blocks held by guessed steps are free for any request. A request short of blocks
undoes the guesses, and no other stream's step may make a new guess and take a block back before the request has
its blocks (found in review: the request then failed where a worker without run-ahead succeeds)."""

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from tiny_models import write_tiny


def test_a_request_short_of_blocks_gets_those_guesses_held(tmp_path):
    engine, _ = build_engine(load_checkpoint(write_tiny("llama_tied", tmp_path / "llama")),
                             EngineConfig(device="cpu", kv_blocks=4, kv_block_size=16, run_ahead="on",
                                          max_model_len=96))

    def step(s):     # as a stream does: the step, then its guess
        out = engine.step(s, run_ahead=True)
        if out.ahead is not None:
            out.ahead.run(lambda: None)
        return out

    t1 = step(Step(prefill=(PrefillSlice(1, tuple(range(10, 25))),))).outputs[0].token    # 15 tokens: 1 block
    step(Step(decode=(DecodeToken(1, t1),)))                          # 16 tokens; its guess takes a 2nd block
    t3 = step(Step(prefill=(PrefillSlice(3, tuple(range(40, 55))),))).outputs[0].token    # 15 tokens: 1 block
    assert engine.stats().free_kv_blocks == 2 and engine.cache.blocks.num_free == 1

    settle = engine.guesses.settle

    def settle_then_another_stream_steps(seq_ids, step_=None, cancelled=lambda: False):
        taken = settle(seq_ids, step_, cancelled)
        if step_ is None and seq_ids == [1]:      # the request's retry: another stream decodes 3 right here
            step(Step(decode=(DecodeToken(3, t3),)))
        return taken

    engine.guesses.settle = settle_then_another_stream_steps
    engine.step(Step(prefill=(PrefillSlice(2, tuple(range(60, 92))),)))                     # 32 tokens: 2 blocks
    assert engine.cache.blocks.num_free == 0 and sorted(engine.sequences.ids()) == [1, 2, 3]
