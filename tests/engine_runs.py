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


def forced_logits(engine, prompt: list[int], continuation: list[int], seq_id: int = 1) -> tuple[list, list[int]]:
    """greedy_logits with the continuation fed in place of the engine's own tokens (teacher forcing): the logits of
    the prompt's last token and of each continuation token, and the token the engine chose after each; the sequence
    is released."""
    out = engine.step(Step(prefill=(PrefillSlice(seq_id, tuple(prompt), output=OutputOptions(return_logits=True)),)))
    logits, chosen = [out.outputs[0].logits], [out.outputs[0].token]
    for token in continuation:
        out = engine.step(Step(decode=(DecodeToken(seq_id, token),)))
        logits.append(out.outputs[0].logits)
        chosen.append(out.outputs[0].token)
    engine.release([seq_id])
    return logits, chosen


def relative_error(logits: list, reference: list) -> list[float]:
    """Each step's max |logit - reference| / max |reference|."""
    return [float((row - want).abs().max() / want.abs().max()) for row, want in zip(logits, reference)]


def blocks_tolerance(bf16: list, reference: list) -> float:
    """The most relative_error the CPU backend's GGUF blocks path may show against float32 (docs/architecture.md):
    it rounds what a bfloat16 model rounds at each linear and keeps the rest float32, so as far from float32 as the
    bfloat16 model (bf16: its logits on the same tokens), with 1.5x for the spread one seed's rounding gives."""
    return 1.5 * max(relative_error(bf16, reference))
