"""Generate: one request's prefill and decode loop through the same streams as the step RPCs.

A debugging aid for grpcurl, not a scheduler: it holds one sequence, streams each token, and releases it.
"""

import asyncio
import math

from metrale.runtime.errors import InvalidArgument, OutOfRange
from metrale.runtime.step import DecodeToken, PrefillSlice, Step
from metrale.service import convert
from metrale.v1 import worker_pb2 as pb


async def _prompt_tokens(request: pb.GenerateRequest, servicer) -> tuple[int, ...]:
    if request.prompt_tokens and request.prompt:
        raise InvalidArgument("give prompt or prompt_tokens, not both")
    if request.prompt_tokens:
        tokens = request.prompt_tokens
    elif request.prompt:
        tokens = await servicer.text.encode(request.prompt, request.add_special_tokens)
    else:
        raise InvalidArgument("the prompt is empty: give prompt or prompt_tokens")
    # An encoder-decoder's prompt is its source; either takes at most max_model_len tokens.
    if len(tokens) > servicer.info.max_model_len:
        raise OutOfRange(f"the prompt's {len(tokens)} tokens pass max_model_len={servicer.info.max_model_len}")
    return tuple(tokens)


async def generate_tokens(request: pb.GenerateRequest, seq_id: int, servicer):
    max_model_len = servicer.info.max_model_len
    if not 1 <= request.max_new_tokens <= max_model_len:
        raise InvalidArgument(f"max_new_tokens={request.max_new_tokens} is out of range: must be in "
                              f"[1, {max_model_len}] (max_model_len)")
    if len(request.stop_token_ids) > servicer.info.vocab_size:
        raise InvalidArgument(f"{len(request.stop_token_ids)} stop_token_ids, more than the vocabulary's "
                              f"{servicer.info.vocab_size} ids")
    first = PrefillSlice(seq_id=seq_id, tokens=await _prompt_tokens(request, servicer), is_last_chunk=True,
                         sampling=convert.sampling_from_pb(request.sampling),
                         output=convert.output_from_pb(request.output))
    stop_ids = set(request.stop_token_ids)
    eos_ids = set() if request.ignore_eos else set(servicer.info.eos_token_ids)
    step = Step(prefill=(first,))
    step.check(servicer.info.vocab_size, max_model_len)
    stream = request.stream
    # The tokens the sequence may still take: an encoder-decoder's decoder holds its start token, not the source.
    room = servicer.info.max_model_len - (1 if servicer.engine.is_encoder_decoder else len(first.tokens))
    generated, emitted, released = [], "", False
    try:
        for index in range(request.max_new_tokens):
            out, _ = await servicer.run_step(stream, step)
            o = out.outputs[0]
            generated.append(o.token)
            last = index == request.max_new_tokens - 1 or index + 1 >= room
            reason = "eos" if o.token in eos_ids else "stop" if o.token in stop_ids else "length" if last else ""
            response = pb.GenerateResponse(token=o.token, index=index, finish_reason=reason)
            if not math.isnan(o.logprob):
                response.logprob = o.logprob
            if servicer.tokenizer is not None:
                # Whole-text decode, so multi-token characters come out whole once complete.
                text = servicer.tokenizer.decode(generated)
                if not text.endswith("\ufffd"):
                    response.text, emitted = text[len(emitted):], text
            if o.top_logprobs is not None:
                response.top_logprobs.CopyFrom(pb.TopLogprobs(seq_id=seq_id, token_ids=o.top_logprobs[0],
                                                              logprobs=o.top_logprobs[1]))
            if reason:      # freed before the last answer, so that a client that then asks Info finds it gone
                released = True
                await asyncio.wrap_future(servicer.release_in_order(stream, [seq_id]))
            yield response
            if reason:
                return
            step = Step(decode=(DecodeToken(seq_id, o.token),))
    finally:
        if not released:    # queued behind this request's last step, which may still run if the client cancelled
            servicer.release_in_order(stream, [seq_id])
