"""A gateway's own loop on an encoder-decoder engine, for the tests: Prefill each source (the encoder runs; the
decoder starts from its start token), then Decode a forced first token (as a target-language token would be) and
the greedy tokens after it, every sequence batched, each step's logits kept."""

from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step


def forced_then_greedy(engine, sources: dict[int, list[int]], forced: dict[int, int], steps: int, start: int
                       ) -> tuple[dict, dict, dict]:
    """Returns, per seq_id: the decoder's tokens so far (start, forced, greedy ones), its logits rows (one per
    decoder token), and the next greedy token."""
    logits = OutputOptions(return_logits=True)
    out = engine.step(Step(prefill=tuple(PrefillSlice(i, tuple(s), output=logits) for i, s in sources.items())))
    decoded = {i: [start] for i in sources}
    rows = {i: [o.logits] for i, o in zip(sources, out.outputs)}
    next_tokens = dict(forced)
    for _ in range(steps):
        out = engine.step(Step(decode=tuple(DecodeToken(i, next_tokens[i]) for i in sources)))
        for o in out.outputs:
            decoded[o.seq_id].append(next_tokens[o.seq_id])
            rows[o.seq_id].append(o.logits)
            next_tokens[o.seq_id] = o.token
    return decoded, rows, next_tokens
