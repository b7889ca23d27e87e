"""A BeamGenerate request as the engine receives it, and the checks that need no model state."""

import math
from dataclasses import dataclass

from metrale.runtime.errors import InvalidArgument, OutOfRange, name_ids
from metrale.runtime.step import check_token_ids

# Beams of one request; the beams of all requests of a call run in one forward per step.
MAX_NUM_BEAMS = 32
# Continuations a step keeps per request, max(2, 1 + number of EOS ids) * num_beams (as transformers), at most:
# each beam's own best that many come back from the backend (Ops.beam_candidates; the CUDA kernel's limit).
MAX_KEEP = 1024
EARLY_STOPPING = (True, False, "never")
# |length_penalty| at most: length ** length_penalty stays within float32 (the device's divisors) for any length up
# to 2^24, with room for a score to be divided by it.
MAX_ABS_LENGTH_PENALTY = 4.0


@dataclass(frozen=True)
class BeamParams:
    num_beams: int = 1
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    # As transformers' early_stopping: True, False or "never".
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    num_return_sequences: int = 1

    def validate(self, where: str, max_model_len: int) -> None:
        if not 1 <= self.num_beams <= MAX_NUM_BEAMS:
            raise InvalidArgument(f"{where}: num_beams must be in [1, {MAX_NUM_BEAMS}], got {self.num_beams}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise InvalidArgument(f"{where}: num_return_sequences must be in [1, num_beams={self.num_beams}], "
                                  f"got {self.num_return_sequences}")
        if not 1 <= self.max_new_tokens <= max_model_len:
            raise InvalidArgument(f"{where}: max_new_tokens must be in [1, {max_model_len}] (max_model_len), "
                                  f"got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidArgument(f"{where}: min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                                  f"got {self.min_new_tokens}")
        if not (math.isfinite(self.length_penalty) and abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY):
            raise InvalidArgument(f"{where}: length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                                  f"{MAX_ABS_LENGTH_PENALTY:g}], got {self.length_penalty}")
        if self.early_stopping not in EARLY_STOPPING:
            raise InvalidArgument(f"{where}: early_stopping must be TRUE, FALSE or NEVER")
        if not 0 <= self.no_repeat_ngram_size <= max_model_len:
            raise InvalidArgument(f"{where}: no_repeat_ngram_size must be in [0, {max_model_len}] (max_model_len; "
                                  f"0 = off), got {self.no_repeat_ngram_size}")


@dataclass(frozen=True)
class BeamRequest:
    request_id: int
    # A decoder-only model's prompt; the search continues it.
    prompt_tokens: tuple[int, ...] = ()
    # An encoder-decoder model's source sentence.
    src_tokens: tuple[int, ...] = ()
    # Tokens the decoder is given before the first searched one (e.g. a target-language token).
    decoder_prefix: tuple[int, ...] = ()
    params: BeamParams = BeamParams()

    def check(self, vocab_size: int, max_model_len: int, is_encoder_decoder: bool) -> None:
        """Checks what needs no sequence state; raises InvalidArgument."""
        where = f"request_id {self.request_id}"
        if is_encoder_decoder and not self.src_tokens:
            raise InvalidArgument(f"{where}: src_tokens is empty; this model is an encoder-decoder")
        if is_encoder_decoder and self.prompt_tokens:
            raise InvalidArgument(f"{where}: prompt_tokens given, but this model is an encoder-decoder: send "
                                  f"src_tokens, and decoder_prefix for the decoder's first tokens")
        if not is_encoder_decoder and self.src_tokens:
            raise InvalidArgument(f"{where}: src_tokens given, but this model is decoder-only: send prompt_tokens")
        if not is_encoder_decoder and not self.prompt_tokens + self.decoder_prefix:
            raise InvalidArgument(f"{where}: prompt_tokens is empty")
        for name in ("prompt_tokens", "src_tokens", "decoder_prefix"):
            if len(getattr(self, name)) > max_model_len:
                raise OutOfRange(f"{where}: {name} has {len(getattr(self, name))} tokens, past "
                                 f"max_model_len={max_model_len}")
        for name in ("prompt_tokens", "src_tokens", "decoder_prefix"):
            check_token_ids(f"{where} {name}", getattr(self, name), vocab_size)
        self.params.validate(where, max_model_len)


def check_requests(requests: list[BeamRequest], vocab_size: int, max_model_len: int, is_encoder_decoder: bool
                   ) -> None:
    if not requests:
        raise InvalidArgument("requests is empty")
    seen: set[int] = set()
    duplicates = sorted({r.request_id for r in requests if r.request_id in seen or seen.add(r.request_id)})
    if duplicates:
        raise InvalidArgument(f"request_id(s) {name_ids(duplicates)} appear more than once in one call")
    for request in requests:
        request.check(vocab_size, max_model_len, is_encoder_decoder)
