"""What several tests run through an engine the same way."""

from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step


def greedy_logits(engine, prompt: list[int], steps: int, seq_id: int = 1) -> tuple[list, list[int]]:
    """The prompt prefilled, then `steps` greedy decode steps: each output's logits (the prompt's last, then each
    step's) and the tokens, prompt first; the sequence stays live."""
    out = engine.step(Step(prefill=(PrefillSlice(seq_id, tuple(prompt), output=OutputOptions(return_logits=True)),)))
    logits, tokens = [out.outputs[0].logits], list(prompt)
    for _ in range(steps):
        tokens.append(out.outputs[0].token)
        out = engine.step(Step(decode=(DecodeToken(seq_id, tokens[-1]),)))
        logits.append(out.outputs[0].logits)
    return logits, tokens
