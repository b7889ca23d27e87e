from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_UNSPECIFIED: _ClassVar[EarlyStopping]
    EARLY_STOPPING_TRUE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_FALSE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_NEVER: _ClassVar[EarlyStopping]
EARLY_STOPPING_UNSPECIFIED: EarlyStopping
EARLY_STOPPING_TRUE: EarlyStopping
EARLY_STOPPING_FALSE: EarlyStopping
EARLY_STOPPING_NEVER: EarlyStopping

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "dtype", "device", "vocab_size", "max_model_len", "kv_block_size", "num_kv_blocks", "free_kv_blocks", "is_mla", "hc_mult", "supports_beam", "is_encoder_decoder", "has_ssm", "eos_token_ids", "bos_token_id", "pad_token_id", "num_streams", "max_batch_tokens", "version", "live_sequences", "prefix_cache", "cached_kv_blocks", "single_chunk_prefill", "max_seqs", "sequence_ttl_seconds", "chat_template", "kv_dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IS_MLA_FIELD_NUMBER: _ClassVar[int]
    HC_MULT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_BEAM_FIELD_NUMBER: _ClassVar[int]
    IS_ENCODER_DECODER_FIELD_NUMBER: _ClassVar[int]
    HAS_SSM_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_CHUNK_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int
    free_kv_blocks: int
    is_mla: bool
    hc_mult: int
    supports_beam: bool
    is_encoder_decoder: bool
    has_ssm: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    pad_token_id: int
    num_streams: int
    max_batch_tokens: int
    version: str
    live_sequences: int
    prefix_cache: bool
    cached_kv_blocks: int
    single_chunk_prefill: bool
    max_seqs: int
    sequence_ttl_seconds: float
    chat_template: str
    kv_dtype: str
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., is_mla: _Optional[bool] = ..., hc_mult: _Optional[int] = ..., supports_beam: _Optional[bool] = ..., is_encoder_decoder: _Optional[bool] = ..., has_ssm: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., num_streams: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., version: _Optional[str] = ..., live_sequences: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., cached_kv_blocks: _Optional[int] = ..., single_chunk_prefill: _Optional[bool] = ..., max_seqs: _Optional[int] = ..., sequence_ttl_seconds: _Optional[float] = ..., chat_template: _Optional[str] = ..., kv_dtype: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("logprobs", "top_logprobs", "return_logits")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    logprobs: bool
    top_logprobs: int
    return_logits: bool
    def __init__(self, logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., return_logits: _Optional[bool] = ...) -> None: ...

class PrefillSlice(_message.Message):
    __slots__ = ("seq_id", "tokens", "chunk_start", "is_last_chunk", "chunk_size", "sampling", "output", "cache_salt")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    chunk_start: int
    is_last_chunk: bool
    chunk_size: int
    sampling: SamplingParams
    output: OutputOptions
    cache_salt: str
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., chunk_start: _Optional[int] = ..., is_last_chunk: _Optional[bool] = ..., chunk_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("slices", "stream")
    SLICES_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[PrefillSlice]
    stream: int
    def __init__(self, slices: _Optional[_Iterable[_Union[PrefillSlice, _Mapping]]] = ..., stream: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("seq_ids", "tokens", "stream")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stream: int
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., stream: _Optional[int] = ...) -> None: ...

class MixedForwardRequest(_message.Message):
    __slots__ = ("decode", "prefill", "stream")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    prefill: PrefillRequest
    stream: int
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., stream: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("seq_id", "token_ids", "logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ("seq_id", "data")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    data: bytes
    def __init__(self, seq_id: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("seq_ids", "tokens", "logprobs", "top_logprobs", "logits", "forward_us", "queue_us", "cached_tokens")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    logits: _containers.RepeatedCompositeFieldContainer[Logits]
    forward_us: int
    queue_us: int
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., logits: _Optional[_Iterable[_Union[Logits, _Mapping]]] = ..., forward_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "decode", "prefill", "mixed")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIXED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    decode: DecodeRequest
    prefill: PrefillRequest
    mixed: MixedForwardRequest
    def __init__(self, step_id: _Optional[int] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., mixed: _Optional[_Union[MixedForwardRequest, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "result", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    result: ForwardResponse
    error: _status_pb2.Status
    def __init__(self, step_id: _Optional[int] = ..., result: _Optional[_Union[ForwardResponse, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class BeamRequest(_message.Message):
    __slots__ = ("request_id", "src_tokens", "prompt_tokens", "decoder_prefix", "num_beams", "max_new_tokens", "min_new_tokens", "length_penalty", "early_stopping", "no_repeat_ngram_size", "num_return_sequences")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    src_tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    decoder_prefix: _containers.RepeatedScalarFieldContainer[int]
    num_beams: int
    max_new_tokens: int
    min_new_tokens: int
    length_penalty: float
    early_stopping: EarlyStopping
    no_repeat_ngram_size: int
    num_return_sequences: int
    def __init__(self, request_id: _Optional[int] = ..., src_tokens: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., decoder_prefix: _Optional[_Iterable[int]] = ..., num_beams: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ..., no_repeat_ngram_size: _Optional[int] = ..., num_return_sequences: _Optional[int] = ...) -> None: ...

class BeamGenerateRequest(_message.Message):
    __slots__ = ("requests", "stream")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[BeamRequest]
    stream: int
    def __init__(self, requests: _Optional[_Iterable[_Union[BeamRequest, _Mapping]]] = ..., stream: _Optional[int] = ...) -> None: ...

class BeamHypothesis(_message.Message):
    __slots__ = ("tokens", "score")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    score: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., score: _Optional[float] = ...) -> None: ...

class BeamResult(_message.Message):
    __slots__ = ("request_id", "hypotheses")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    hypotheses: _containers.RepeatedCompositeFieldContainer[BeamHypothesis]
    def __init__(self, request_id: _Optional[int] = ..., hypotheses: _Optional[_Iterable[_Union[BeamHypothesis, _Mapping]]] = ...) -> None: ...

class BeamGenerateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BeamResult]
    def __init__(self, results: _Optional[_Iterable[_Union[BeamResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids", "all")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    all: bool
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., all: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_seq_ids", "unknown_seq_ids", "blocks_freed")
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    unknown_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks_freed: int
    def __init__(self, released_seq_ids: _Optional[_Iterable[int]] = ..., unknown_seq_ids: _Optional[_Iterable[int]] = ..., blocks_freed: _Optional[int] = ...) -> None: ...

class PrefillTailSplitRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillTailSplitResponse(_message.Message):
    __slots__ = ("split",)
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    split: int
    def __init__(self, split: _Optional[int] = ...) -> None: ...

class NormalizeSsmStatesRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NormalizeSsmStatesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens", "skip_special_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_tokens", "max_new_tokens", "sampling", "stop_token_ids", "ignore_eos", "output", "stream", "add_special_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    output: OutputOptions
    stream: int
    add_special_tokens: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., stream: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("tokens", "cache_salt")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("parent_seq_id", "child_seq_ids", "stream")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    stream: int
    def __init__(self, parent_seq_id: _Optional[int] = ..., child_seq_ids: _Optional[_Iterable[int]] = ..., stream: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("child_seq_ids", "blocks_shared")
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks_shared: int
    def __init__(self, child_seq_ids: _Optional[_Iterable[int]] = ..., blocks_shared: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "text", "logprob", "index", "finish_reason", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    text: str
    logprob: float
    index: int
    finish_reason: str
    top_logprobs: TopLogprobs
    def __init__(self, token: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...
