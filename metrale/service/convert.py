"""Protobuf messages to runtime objects and back."""

import numpy as np

from metrale.runtime.beam.params import BeamParams, BeamRequest
from metrale.runtime.beam.call import BeamResult
from metrale.runtime.sampling import OutputOptions, SamplingParams
from metrale.runtime.step import DecodeToken, PrefillSlice, Step, StepOutput
from metrale.runtime.errors import InvalidArgument
from metrale.v1 import worker_pb2 as pb


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p or 1.0, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None, repetition_penalty=m.repetition_penalty or 1.0,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        logit_bias=tuple(sorted(m.logit_bias.items())))


def output_from_pb(m: pb.OutputOptions) -> OutputOptions:
    return OutputOptions(logprobs=m.logprobs, top_logprobs=m.top_logprobs, return_logits=m.return_logits)


def slice_from_pb(m: pb.PrefillSlice) -> PrefillSlice:
    return PrefillSlice(seq_id=m.seq_id, tokens=tuple(m.tokens), chunk_start=m.chunk_start,
                        is_last_chunk=m.is_last_chunk, chunk_size=m.chunk_size,
                        sampling=sampling_from_pb(m.sampling), output=output_from_pb(m.output),
                        cache_salt=m.cache_salt)


def decode_tokens_from_pb(m: pb.DecodeRequest) -> tuple[DecodeToken, ...]:
    if len(m.seq_ids) != len(m.tokens):
        raise InvalidArgument(f"seq_ids has {len(m.seq_ids)} entries but tokens has {len(m.tokens)}; "
                              f"they are parallel arrays")
    return tuple(map(DecodeToken._make, zip(m.seq_ids, m.tokens)))


def step_from_prefill(m: pb.PrefillRequest) -> Step:
    return Step(prefill=tuple(slice_from_pb(s) for s in m.slices))


def step_from_decode(m: pb.DecodeRequest) -> Step:
    return Step(decode=decode_tokens_from_pb(m))


def step_from_mixed(m: pb.MixedForwardRequest) -> Step:
    return Step(decode=decode_tokens_from_pb(m.decode), prefill=tuple(slice_from_pb(s) for s in m.prefill.slices))


# A request carrying more ids (sequence ids and tokens) than this is converted and checked off the event loop.
INLINE_IDS = 1 << 14
# Repeated messages (slices, beam requests) counted one by one at most; past it a request counts as MANY ids.
COUNTED_MESSAGES = 1 << 10
MANY = 1 << 30


def step_id_count(m) -> int:
    """The ids a Prefill, Decode or MixedForward request carries (sequence ids, tokens, logit_bias entries), counted
    without a walk over any one repeated field."""
    decode = m.decode if isinstance(m, pb.MixedForwardRequest) else m if isinstance(m, pb.DecodeRequest) else None
    prefill = m.prefill if isinstance(m, pb.MixedForwardRequest) else m if isinstance(m, pb.PrefillRequest) else None
    count = 2 * len(decode.seq_ids) if decode is not None else 0
    if prefill is not None:
        if len(prefill.slices) > COUNTED_MESSAGES:
            return MANY
        count += sum(1 + len(s.tokens) + len(s.sampling.logit_bias) for s in prefill.slices)
    return count


def beam_id_count(m: pb.BeamGenerateRequest) -> int:
    """The ids a BeamGenerate request carries, counted as step_id_count does."""
    if len(m.requests) > COUNTED_MESSAGES:
        return MANY
    return sum(1 + len(r.prompt_tokens) + len(r.src_tokens) + len(r.decoder_prefix) for r in m.requests)


def forward_response(out: StepOutput, response: pb.ForwardResponse) -> pb.ForwardResponse:
    """The step's outputs, written into response (empty: a new one, or a StepResponse's result); queue_us is the
    caller's to set once the stream has said it."""
    response.forward_us = out.forward_us
    if not out.outputs:
        return response
    seq_ids, tokens, logprobs, tops, logits, cached = zip(*out.outputs)     # the columns, in one pass
    response.seq_ids[:] = seq_ids
    response.tokens[:] = tokens
    response.logprobs[:] = logprobs
    response.cached_tokens[:] = cached
    if tops.count(None) < len(tops) or logits.count(None) < len(logits):
        for o in out.outputs:
            if o.top_logprobs is not None:
                ids, values = o.top_logprobs
                response.top_logprobs.add(seq_id=o.seq_id, token_ids=ids, logprobs=values)
            if o.logits is not None:
                data = o.logits.float().numpy().astype("<f4", copy=False).tobytes()
                response.logits.add(seq_id=o.seq_id, data=data)
    return response


EARLY_STOPPING = {pb.EARLY_STOPPING_UNSPECIFIED: False, pb.EARLY_STOPPING_TRUE: True,
                  pb.EARLY_STOPPING_FALSE: False, pb.EARLY_STOPPING_NEVER: "never"}


def beam_requests_from_pb(m: pb.BeamGenerateRequest) -> list[BeamRequest]:
    """Unset fields take transformers' defaults (length_penalty 1.0, early_stopping False, one sequence back)."""
    return [BeamRequest(
        request_id=r.request_id, prompt_tokens=tuple(r.prompt_tokens), src_tokens=tuple(r.src_tokens),
        decoder_prefix=tuple(r.decoder_prefix),
        params=BeamParams(num_beams=r.num_beams, max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                          length_penalty=_decimal(r.length_penalty) if r.HasField("length_penalty") else 1.0,
                          early_stopping=EARLY_STOPPING.get(r.early_stopping, None),
                          no_repeat_ngram_size=r.no_repeat_ngram_size,
                          num_return_sequences=r.num_return_sequences or 1)) for r in m.requests]


def beam_response(results: list[BeamResult]) -> pb.BeamGenerateResponse:
    return pb.BeamGenerateResponse(results=[
        pb.BeamResult(request_id=r.request_id, hypotheses=[pb.BeamHypothesis(tokens=tokens, score=score)
                                                           for tokens, score in r.hypotheses])
        for r in results])


def _decimal(value: float) -> float:
    """A float field's value as the decimal the client wrote: 0.6 travels as the float32 0.6000000238..., and the
    search divides by length ** length_penalty in double, as transformers does with the Python float 0.6."""
    return float(str(np.float32(value)))
