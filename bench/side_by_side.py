"""What bench/gpu_decode.py measures beside the engine: the same-model check against the peer, the peer's prefill,
and transformers' eager generate on the same checkpoint."""

import time

import torch

from bench.engine_runner import EngineRunner
from bench.peer_llama import DeviceTimer, peer_prefill, synchronize
from metrale.runtime.sampling import OutputOptions
from metrale.runtime.step import DecodeToken, PrefillSlice, Step


def check_same_model(ours: EngineRunner, peer, tokens: torch.Tensor, decode_steps: int) -> dict:
    """Prefills tokens [n, T] on both and decodes decode_steps steps, both fed the engine's tokens; the relative
    error of the peer's (eager) logits against the engine's at each step."""
    engine, n, length = ours.engine, tokens.shape[0], tokens.shape[1]
    ids = ours.new_ids(n)
    out = engine.step(Step(prefill=tuple(PrefillSlice(i, tuple(row), output=OutputOptions(return_logits=True))
                                         for i, row in zip(ids, tokens.tolist()))))
    peer.use_rows(n)
    _, theirs = peer_prefill(peer, tokens, return_logits=True)
    errors, same, finite = [], 0, True
    try:
        for step in range(decode_steps + 1):
            mine = torch.stack([o.logits.float() for o in out.outputs])
            theirs = theirs.float().cpu()
            errors.append(((mine - theirs).norm() / mine.norm()).item())
            same += int((mine.argmax(-1) == theirs.argmax(-1)).sum())
            finite = finite and bool(torch.isfinite(mine).all() and torch.isfinite(theirs).all())
            if step == decode_steps:
                break
            next_tokens = [o.token for o in out.outputs]
            out = engine.step(Step(decode=tuple(DecodeToken(i, t) for i, t in zip(ids, next_tokens))))
            position = torch.tensor([length + step], device=tokens.device)
            with torch.no_grad():
                theirs = peer.model(torch.tensor(next_tokens, device=tokens.device).view(n, 1), position, peer.caches)
    finally:
        engine.release(ids)
    return {"relative_error": max(errors), "errors": errors, "same_argmax": same, "compared": n * len(errors),
            "prompts": n, "finite": finite}


@torch.no_grad()
def time_hf_generate(checkpoint, device: str, prompt: torch.Tensor, new_tokens: int, compile: bool = False) -> float:
    """ms per generated token of Hugging Face transformers' eager generate (greedy, batch 1, bf16 on the GPU):
    the time of new_tokens tokens less the time of one (the prefill), over new_tokens - 1. compile: its forward
    under torch.compile (default mode), compiled by warm-up generates of every length timed."""
    import transformers
    config = transformers.AutoConfig.for_model(**checkpoint.config)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in checkpoint.tensors.items()},
                                                strict=False)
    if unexpected or any(not name.startswith("lm_head") for name in missing):
        raise RuntimeError(f"the checkpoint does not fit transformers' model: missing {missing}, "
                           f"unexpected {unexpected}")
    if "lm_head.weight" in missing:
        model.tie_weights()
    return time_generate(model, device, prompt, new_tokens, compile)


@torch.no_grad()
def time_generate(model, device: str, prompt: torch.Tensor, new_tokens: int, compile: bool = False) -> float:
    """time_hf_generate's timing of a transformers model already loaded."""
    ids = prompt.to(device)

    def generate(n: int) -> float:
        synchronize(device)
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - started
    if compile:
        model.forward = torch.compile(model.forward)
        for n in (1, 2, new_tokens):                    # the prefill's and the steps' shapes, then dynamic ones
            generate(n)
    generate(2)                                         # warm-up
    one = min(generate(1) for _ in range(2))
    many = min(generate(new_tokens) for _ in range(2))
    return (many - one) / (new_tokens - 1) * 1e3


def chunks_of(tokens: torch.Tensor, size: int):
    """(row offset, rows) of at most `size` rows each."""
    return [(start, tokens[start:start + size]) for start in range(0, tokens.shape[0], size)]


def time_peer_prefill(peer, tokens: torch.Tensor, warmup: int, reps: int) -> list[float]:
    """Eager prefill of every row of tokens [n, T] from position 0 into cache rows [0, n), greedy next token
    included; device time per prefill (CUDA events)."""
    device = tokens.device
    peer.use_rows(tokens.shape[0])
    for _ in range(warmup):
        peer_prefill(peer, tokens)
    synchronize(device)
    timer = DeviceTimer(device)
    for _ in range(reps):
        started = timer.start()
        peer_prefill(peer, tokens)
        timer.stop(started)
    return timer.elapsed_ms()
