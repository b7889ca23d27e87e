"""What FP8 costs in accuracy on a real model: the embedded default model (SmolLM2-135M-Instruct; its GGUF dequantized
to bf16, or float32 with --dtype float32, is the yardstick) against the same model with its linear weights quantized
to FP8 at load (--quantize fp8, the default), its KV cache in FP8 (--kv-dtype fp8), or both. On the CUDA backend FP8
weights are W8A16 at decode rows and W8A8 (inputs quantized per token) in prompts. Two figures:
- greedy: the base run's 64 greedy tokens after each chat prompt, the FP8 run fed the same tokens; the share of
  steps whose FP8 argmax is the base run's token, and how long the FP8 run's own greedy continuation stays equal;
- perplexity of a fixed English text: its first half a prompt (a prefill), its second half fed token by token
  (decode steps); each run's perplexity of the second half, and their ratio.

Run from the repository root: python3 -m bench.fp8_accuracy [--model PATH] [--device cuda] [--steps 64]
    [--quantize fp8|none] [--kv-dtype auto|fp8] [--dtype bfloat16|float32]
"""

import argparse
import math

import torch

from bench.gguf_accuracy import QUESTIONS, decode, prompt_ids
from bench.gpu_ceilings import gpu_machine_line
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.default_model import default_cache_dir, fetch_default_model
from metrale.runtime.loading import load_checkpoint

TEXT = (
    "The river ran slowly through the valley, past the old mill and the fields of barley that the farmers had sown "
    "in the spring. In the evenings the children would walk along its banks, throwing stones into the water and "
    "watching the ripples spread until they reached the reeds on the far side. Nobody in the village could remember "
    "a time when the river had been different, although the oldest woman there liked to say that her grandmother "
    "had seen it freeze from one bank to the other in a winter so cold that the birds fell silent for a month. The "
    "mill itself had stopped turning long ago. Its wheel was green with moss, and the miller's house beside it had "
    "become a small school, where a single teacher taught reading, arithmetic and the names of the stars to twenty "
    "pupils of every age. On clear nights she would take them up the hill behind the church, and they would lie on "
    "the grass while she pointed out the constellations one by one, telling the stories that the ancient Greeks had "
    "told about each of them. Many of those children later left the valley for the cities, for work in offices and "
    "factories and hospitals, but most of them said, when they were old, that they had never again seen a sky as "
    "full of stars as the one above the hill on those summer nights, and that they could still name every one. "
    "In the autumn the valley changed its colours. The beech trees on the slopes turned copper and gold, the "
    "orchards were heavy with apples, and every family spent a week bringing in the harvest before the first "
    "frosts. The market in the square grew loud with bargaining: cheeses and honey, jars of plum jam, baskets woven "
    "from willow, and the knives that the blacksmith sharpened while his customers waited and talked about the "
    "weather. Travellers sometimes came through on their way to the mountains, and the innkeeper would ask each of "
    "them for news of the world beyond the pass, writing down what they told him in a thick book that he kept "
    "behind the bar. Over forty years the book had filled with accounts of elections and floods, of new railways "
    "and old kings, of inventions that nobody in the valley had yet seen. When the first motor car finally drove "
    "into the square, half the village came out to look at it, and the innkeeper wrote three whole pages about "
    "the event, describing the noise of the engine, the smell of the fuel and the astonished face of the baker's "
    "horse. Winter, when it came, was long and quiet. Snow closed the road over the pass for weeks at a time, and "
    "the people of the valley depended on what they had stored: flour and potatoes, smoked meat, firewood stacked "
    "against every wall. In the long evenings they mended tools, knitted, played cards and told the same stories "
    "they had told the winter before, changing a detail here and there so that the stories grew a little every "
    "year. By the time spring returned and the river rose with melted snow, the tales had become legends, and the "
    "children who had heard them by the fire repeated them to each other as if they had always been true.")


def perplexity(engine, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids' second half: the first half prefilled, the rest fed one
    token a step (each step's logits score the next token)."""
    half = len(ids) // 2
    logits, _ = decode(engine, ids[:half], len(ids) - half - 1, fed=ids[half:])
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    targets = torch.tensor(ids[half:])
    return math.exp(-float(log_probs[torch.arange(len(targets)), targets].mean()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file; default: the embedded model")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke test's path")
    parser.add_argument("--steps", type=int, default=64, help="greedy decode steps after each prompt")
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help="how many of the chat prompts")
    parser.add_argument("--text-tokens", type=int, default=None, help="score only the text's first this many tokens")
    parser.add_argument("--quantize", default="fp8", choices=("fp8", "none"), help="the FP8 run's weights")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"), help="the FP8 run's KV cache")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="both runs' dtype")
    args = parser.parse_args(argv)
    if args.quantize == "none" and args.kv_dtype == "auto":
        parser.error("nothing in FP8: give --quantize fp8 and/or --kv-dtype fp8")
    checkpoint = load_checkpoint(args.model or fetch_default_model(default_cache_dir()))
    text = checkpoint.tokenizer.encode(TEXT) if checkpoint.tokenizer is not None else list(TEXT.encode())
    text = text[:args.text_tokens]
    prompts = {question: prompt_ids(checkpoint, question) for question in QUESTIONS[:args.prompts]}
    max_len = max([len(text)] + [len(p) + args.steps + 1 for p in prompts.values()])
    engines = {name: build_engine(checkpoint, EngineConfig(device=args.device, max_model_len=max_len, kv_blocks=
                                                           4 * max_len, dtype=args.dtype, **settings))[0]
               for name, settings in (("base", {}), ("fp8", dict(quantize=args.quantize, kv_dtype=args.kv_dtype)))}
    print(gpu_machine_line("fp8_accuracy", args.device))
    print(f"# {checkpoint.source}: {args.dtype} (dequantized) against --quantize {args.quantize} --kv-dtype "
          f"{args.kv_dtype}, {args.steps} greedy steps a prompt")
    print(f"{'prompt':<30}  {'argmax = base':>13}  {'same until':>10}")
    agree = steps = 0
    for question, prompt in prompts.items():
        _, reference = decode(engines["base"], prompt, args.steps)
        logits, _ = decode(engines["fp8"], prompt, args.steps, fed=reference)
        _, own = decode(engines["fp8"], prompt, args.steps)
        same = sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), reference))
        until = next((i for i, (a, b) in enumerate(zip(own, reference)) if a != b), len(reference))
        agree, steps = agree + same, steps + len(reference)
        print(f"{question[:30]:<30}  {f'{same}/{len(reference)}':>13}  {until:>10}")
    ppl = {name: perplexity(engine, text) for name, engine in engines.items()}
    print(f"# greedy: {agree}/{steps} steps ({agree / steps:.3f}) take the base run's token; perplexity of the "
          f"text's second half ({len(text) - len(text) // 2} of {len(text)} tokens): base {ppl['base']:.4f}, fp8 "
          f"{ppl['fp8']:.4f} ({ppl['fp8'] / ppl['base'] - 1:+.2%})")
    return {"agree": agree, "steps": steps, "perplexity": ppl}


if __name__ == "__main__":
    main()
