"""How far the CPU backend's GGUF blocks path is from the same model dequantized to float32 (--dequantize), with a
bfloat16 model (--dequantize --dtype bfloat16) as the yardstick: greedy continuations of chat prompts on float32,
the other two fed the same tokens, their logits compared step by step.

Run from the repository root: python -m bench.gguf_accuracy [--steps 64] [--model PATH]
"""

import argparse
from dataclasses import dataclass

import jinja2
import torch

from bench.grpc_overhead import machine_line
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.default_model import default_cache_dir, fetch_default_model
from metrale.runtime.loading import Checkpoint, load_checkpoint
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step

QUESTIONS = ("What is the capital of France?", "Write a short poem about the sea.",
             "Explain how a transistor works in simple terms.", "Give me three tips for learning Python.",
             "What causes the seasons on Earth?")
# name -> EngineConfig fields of the runs compared with float32
RUNS = {"blocks": dict(dequantize=False), "bfloat16": dict(dequantize=True, dtype="bfloat16")}


@dataclass
class Row:
    prompt: str
    run: str
    max_error: float        # max over steps of max |logit - float32's| / max |float32's logit|
    mean_error: float
    agree: int              # steps whose argmax is float32's
    steps: int
    flip_margin: float      # float32's largest top-2 margin where the argmax differs (0: none differs)
    same_until: int         # steps the run's own greedy tokens equal float32's


def prompt_ids(checkpoint: Checkpoint, question: str) -> list[int]:
    """The question as a one-turn chat in the model's template; a checkpoint without a tokenizer (tiny test models)
    gets its UTF-8 bytes as ids."""
    tokenizer = checkpoint.tokenizer
    if tokenizer is None:
        return list(question.encode()[:32])
    if not tokenizer.chat_template:
        return tokenizer.encode(question)
    text = jinja2.Template(tokenizer.chat_template).render(messages=[{"role": "user", "content": question}],
                                                           add_generation_prompt=True)
    return tokenizer.encode(text)


def decode(engine, prompt: list[int], steps: int, fed: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Logits [steps + 1, vocab] of the prompt's last token and of each token after it, and the tokens the engine
    chose; fed: the tokens given to it instead of its own choices."""
    out = engine.step(Step(prefill=(PrefillSlice(1, tuple(prompt), output=OutputOptions(return_logits=True)),)))
    logits, chosen = [out.outputs[0].logits], [out.outputs[0].token]
    for i in range(steps):
        out = engine.step(Step(decode=(DecodeToken(1, fed[i] if fed else chosen[-1]),)))
        logits.append(out.outputs[0].logits)
        chosen.append(out.outputs[0].token)
    engine.release([1])
    return torch.stack(logits), chosen


def compare(prompt: str, run: str, logits: torch.Tensor, own_tokens: list[int], reference: torch.Tensor,
            reference_tokens: list[int]) -> Row:
    errors = (logits - reference).abs().amax(-1) / reference.abs().amax(-1)
    top2 = reference.topk(2, dim=-1).values
    differs = logits.argmax(-1) != reference.argmax(-1)
    margins = (top2[:, 0] - top2[:, 1])[differs]
    same = next((i for i, (a, b) in enumerate(zip(own_tokens, reference_tokens)) if a != b), len(reference_tokens))
    return Row(prompt, run, float(errors.max()), float(errors.mean()), int((~differs).sum()), len(errors),
               float(margins.max()) if len(margins) else 0.0, same)


def format_table(rows: list[Row]) -> str:
    lines = [f"{'prompt':<30}  {'run':<8}  {'max rel':>7}  {'mean rel':>8}  {'argmax =':>8}  {'flip margin':>11}  "
             f"{'same until':>10}"]
    lines += [f"{r.prompt[:30]:<30}  {r.run:<8}  {r.max_error:>7.4f}  {r.mean_error:>8.4f}  "
              f"{f'{r.agree}/{r.steps}':>8}  {r.flip_margin:>11.3f}  {r.same_until:>10}" for r in rows]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file; default: the embedded model")
    parser.add_argument("--steps", type=int, default=64, help="greedy decode steps after each prompt")
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help="how many of the chat prompts")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    checkpoint = load_checkpoint(args.model or fetch_default_model(default_cache_dir()))
    prompts = {question: prompt_ids(checkpoint, question) for question in QUESTIONS[:args.prompts]}
    max_len = max(map(len, prompts.values())) + args.steps + 1
    engines = {name: build_engine(checkpoint, EngineConfig(device="cpu", max_model_len=max_len, kv_blocks=2 * max_len,
                                                           **config))[0]
               for name, config in {"float32": dict(dequantize=True), **RUNS}.items()}
    print(machine_line("gguf_accuracy"))
    print(f"# {checkpoint.source}: {args.steps} greedy steps of float32 (dequantized) after each prompt; each run "
          f"fed the same tokens (argmax =, max/mean rel: logits against float32's) and decoding its own (same until)")
    rows = []
    for question, prompt in prompts.items():
        reference, reference_tokens = decode(engines["float32"], prompt, args.steps)
        for run in RUNS:
            logits, _ = decode(engines[run], prompt, args.steps, fed=reference_tokens)
            _, own_tokens = decode(engines[run], prompt, args.steps)
            rows.append(compare(question, run, logits, own_tokens, reference, reference_tokens))
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
