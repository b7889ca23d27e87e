"""Launchers for cuda_kernels/sampling.cu: penalties on a copy of the logits, then each row's token, its logprob
and top-n logprobs by the rule of metrale/runtime/sampling/sampler.py; and the host packers of their inputs."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from metrale.runtime.backend.cuda.launch import launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.sampling.params import MAX_TOP_LOGPROBS, OutputOptions, SamplingParams
from metrale.runtime.sampling.sampler import SampleRow

MODULE = "sampling"
THREADS = 1024                 # as SAMPLE_THREADS in sampling_primitives.cuh: one block per row
MAX_VOCAB = 1 << 20            # fixed-point masses (2^43 per token) stay below 2^63
PARAM_WORDS = 16               # int32 words per row: struct SampleParams, 64 bytes
ENTRY_WORDS = 5                # penalty entry: token id, output count, in history, first bias, number of biases
FLAG_GREEDY, FLAG_PENALISED, FLAG_LOGPROBS = 1, 2, 4
TOP_P_OFF = 2.0
NULL = np.uint64(0)
MASK64, LOW32, SHIFT32 = 2**64 - 1, np.uint64(0xFFFFFFFF), np.uint64(32)
PACKED_PAIRS_LIMIT = 4096       # pack_sampling_params's cache starts over past this many pairs
WIDEN_THREADS = 256            # as in sampling.cu
WIDEN_PER_THREAD = 16          # widen_rows: about this many values a thread, so vocab / 4096 blocks a row,
WIDEN_MAX_CHUNKS = 64          # at most this many

# struct SampleParams of sampling_primitives.cuh, little-endian
PARAMS_DTYPE = np.dtype({
    "names": ["top_p_limit", "temperature", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
              "top_k", "seed_lo", "seed_hi", "position_lo", "position_hi", "flags", "top_logprobs"],
    "formats": ["<f8", "<f4", "<f4", "<f4", "<f4", "<f4", "<i4", "<u4", "<u4", "<u4", "<u4", "<i4", "<i4"],
    "offsets": [0, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52],
    "itemsize": 4 * PARAM_WORDS,
})


@dataclass
class PenaltyLists:
    """The penalised rows' distinct tokens, CSR by row, for apply_penalties."""
    entry_offsets: np.ndarray  # [N + 1] int32: row i's entries are entry_offsets[i] .. entry_offsets[i + 1]
    entries: np.ndarray        # [E, ENTRY_WORDS] int32
    biases: np.ndarray         # [B] float32, each token's logit_bias values in the request's order


def pack_sampling_params(rows: Sequence[SampleRow], packed_pairs: dict | None = None) -> np.ndarray:
    """[N, PARAM_WORDS] int32: each row's SampleParams as sample_rows and apply_penalties read them. packed_pairs:
    a cache the caller keeps across calls (a sequence's parameter and option objects are the same at every step):
    the fields of each (params, options) pair are packed once, the seeds and positions as whole columns."""
    cache = {} if packed_pairs is None else packed_pairs
    if len(cache) > PACKED_PAIRS_LIMIT:
        cache.clear()

    def fields_of(row: SampleRow) -> bytes:
        key = (id(row.params), id(row.options))
        entry = cache.get(key)
        if entry is None:       # the entry holds the objects, so their ids stay theirs while it lives
            entry = cache[key] = (row.params, row.options, _pair_fields(row.params, row.options))
        return entry[2]

    n = len(rows)
    words = np.frombuffer(b"".join(map(fields_of, rows)), dtype=np.int32).reshape(n, PARAM_WORDS).copy()
    packed = words.view(PARAMS_DTYPE).reshape(n)
    seeds = np.fromiter((row.seed & MASK64 for row in rows), dtype=np.uint64, count=n)
    positions = np.fromiter((row.position & MASK64 for row in rows), dtype=np.uint64, count=n)
    packed["seed_lo"], packed["seed_hi"] = seeds & LOW32, seeds >> SHIFT32
    packed["position_lo"], packed["position_hi"] = positions & LOW32, positions >> SHIFT32
    return words


def _pair_fields(params: SamplingParams, options: OutputOptions) -> bytes:
    """The SampleParams image of a parameter and option pair, seed and position 0."""
    flags = ((FLAG_GREEDY if params.is_greedy else 0) | (FLAG_PENALISED if params.has_penalties else 0)
             | (FLAG_LOGPROBS if options.logprobs else 0))
    # the CPU's cut: keep a token while the float64 mass before it is < top_p, i.e. <= nextafter(top_p, -1)
    top_p_limit = math.nextafter(params.top_p, -1.0) if params.top_p < 1.0 else TOP_P_OFF
    packed = np.zeros(1, dtype=PARAMS_DTYPE)
    packed[0] = (top_p_limit, params.temperature, params.min_p, params.repetition_penalty, params.frequency_penalty,
                 params.presence_penalty, min(params.top_k, 2**31 - 1), 0, 0, 0, 0, flags, options.top_logprobs)
    return packed.tobytes()


def pack_penalties(rows: Sequence[SampleRow], vocab_size: int) -> PenaltyLists:
    """The entries apply_penalties needs, by the CPU rule: repetition over the distinct history ids, frequency and
    presence over the output ids with their counts, logit_bias in order; ids outside the row are skipped."""
    offsets, entries, biases = [0], [], []
    for row in rows:
        params = row.params
        if params.has_penalties:
            by_id: dict[int, list[int]] = {}
            if params.repetition_penalty != 1.0 and len(row.history):
                for token_id in np.unique(_valid_ids(row.history, vocab_size)).tolist():
                    by_id.setdefault(token_id, [token_id, 0, 0, 0, 0])[2] = 1
            if (params.frequency_penalty or params.presence_penalty) and len(row.output_tokens):
                ids, counts = np.unique(_valid_ids(row.output_tokens, vocab_size), return_counts=True)
                for token_id, count in zip(ids.tolist(), counts.tolist()):
                    by_id.setdefault(token_id, [token_id, 0, 0, 0, 0])[1] = count
            bias_lists: dict[int, list[float]] = {}
            for token_id, bias in params.logit_bias:
                if not 0 <= token_id < vocab_size:
                    raise InvalidArgument(f"logit_bias token id {token_id} is outside the vocabulary ({vocab_size})")
                bias_lists.setdefault(token_id, []).append(bias)
                by_id.setdefault(token_id, [token_id, 0, 0, 0, 0])
            for token_id, entry in sorted(by_id.items()):
                own = bias_lists.get(token_id, [])
                entry[3], entry[4] = len(biases), len(own)
                biases.extend(own)
                entries.append(entry)
        offsets.append(len(entries))
    return PenaltyLists(np.array(offsets, dtype=np.int32),
                        np.array(entries, dtype=np.int32).reshape(len(entries), ENTRY_WORDS),
                        np.array(biases, dtype=np.float32))


def _valid_ids(tokens, vocab_size: int) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    return ids[(ids >= 0) & (ids < vocab_size)]


def widen_rows(lib, stream, out: DeviceTensor, logits: DeviceTensor) -> None:
    """out [N, V] float32 = logits [N, V] bf16 (the LM head's output), as transformers widens its logits before the
    processors: the rows apply_penalties and sample_rows read."""
    require(logits.dtype == "bfloat16" and len(logits.shape) == 2, "widen_rows: logits must be [N, V] bf16")
    require(out.dtype == "float32" and out.shape == logits.shape,
            f"widen_rows: out {out.shape} {out.dtype} must be float32 {logits.shape}")
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    chunks = min(-(-vocab_size // (WIDEN_THREADS * WIDEN_PER_THREAD)), WIDEN_MAX_CHUNKS)
    launch_kernel(stream, lib.get("widen_rows", MODULE), (num_rows, chunks), WIDEN_THREADS, out,
                  np.int64(out.stride), logits, np.int64(logits.stride), vocab_size)


def apply_penalties(lib, stream, processed: DeviceTensor, logits: DeviceTensor, params: DeviceTensor,
                    entry_offsets: DeviceTensor, entries: DeviceTensor, biases: DeviceTensor) -> None:
    """processed [N, V] float32 = logits [N, V] float32 with penalties and logit_bias, for the rows packed with
    FLAG_PENALISED (as sampler.apply_penalties, clamp included); other rows of processed are not written.
    params: pack_sampling_params; entry_offsets, entries, biases: pack_penalties, on the device."""
    num_rows, vocab_size = _check_logits("apply_penalties", logits, params)
    require(processed.dtype == "float32" and processed.shape == logits.shape,
            f"apply_penalties: processed {processed.shape} {processed.dtype} must be float32 {logits.shape}")
    require(entry_offsets.dtype == "int32" and entry_offsets.shape == (num_rows + 1,),
            f"apply_penalties: entry_offsets must be [{num_rows + 1}] int32, not {entry_offsets.shape}")
    require(entries.dtype == "int32" and len(entries.shape) == 2 and entries.shape[1] == ENTRY_WORDS
            and entries.is_contiguous, f"apply_penalties: entries must be [E, {ENTRY_WORDS}] int32, contiguous")
    require(biases.dtype == "float32" and len(biases.shape) == 1, "apply_penalties: biases must be [B] float32")
    if num_rows == 0:
        return
    kernel = lib.get("apply_penalties", MODULE)
    launch_kernel(stream, kernel, num_rows, THREADS, processed, np.int64(processed.stride), logits,
                  np.int64(logits.stride), params, vocab_size, entry_offsets, _pointer(entries), _pointer(biases))


def sample_rows(lib, stream, logits: DeviceTensor, params: DeviceTensor, tokens_out: DeviceTensor,
                logprobs_out: DeviceTensor, top_ids_out: DeviceTensor | None, top_logprobs_out: DeviceTensor | None,
                top_n: int, processed: DeviceTensor | None = None) -> None:
    """Each row's token, from logits [N, V] float32 (raw) or, for rows packed with FLAG_PENALISED, from
    processed [N, V] (apply_penalties' output; None: no row has penalties).
    tokens_out [N] int32: the token; -1 where the CPU sampler raises (NaN or +inf logits, no finite maximum).
    logprobs_out [N] float32: log_softmax(raw)[token] where the row asked for logprobs, else NaN.
    top_ids_out [N, >= top_n] int32, top_logprobs_out [N, >= top_n] float32 (None with top_n 0): the row's
    n = min(options.top_logprobs, top_n) best of log_softmax(raw), best first, ties to the lower id, then -1 and
    NaN up to column top_n. params: pack_sampling_params(rows) on the device."""
    num_rows, vocab_size = _check_logits("sample_rows", logits, params)
    if processed is None:
        processed = logits
    require(processed.dtype == "float32" and processed.shape == logits.shape,
            f"sample_rows: processed {processed.shape} {processed.dtype} must be float32 {logits.shape}")
    require(tokens_out.dtype == "int32" and tokens_out.shape == (num_rows,),
            f"sample_rows: tokens_out must be [{num_rows}] int32, not {tokens_out.shape} {tokens_out.dtype}")
    require(logprobs_out.dtype == "float32" and logprobs_out.shape == (num_rows,),
            f"sample_rows: logprobs_out must be [{num_rows}] float32, not {logprobs_out.shape} {logprobs_out.dtype}")
    require(isinstance(top_n, int) and 0 <= top_n <= MAX_TOP_LOGPROBS,
            f"sample_rows: top_n {top_n} must be in [0, {MAX_TOP_LOGPROBS}]")
    if top_n:
        for name, tensor, dtype in (("top_ids_out", top_ids_out, "int32"), ("top_logprobs_out", top_logprobs_out,
                                                                            "float32")):
            require(tensor is not None and tensor.dtype == dtype and len(tensor.shape) == 2
                    and tensor.shape[0] == num_rows and tensor.shape[1] >= top_n,
                    f"sample_rows: {name} must be [{num_rows}, >= {top_n}] {dtype}")
    if num_rows == 0:
        return
    top_ids = top_ids_out if top_n else None
    top_logprobs = top_logprobs_out if top_n else None
    kernel = lib.get("sample_rows", MODULE)
    launch_kernel(stream, kernel, num_rows, THREADS, logits, np.int64(logits.stride), processed,
                  np.int64(processed.stride), params, vocab_size, tokens_out, logprobs_out, _pointer(top_ids),
                  np.int64(top_ids.stride if top_ids else 0), _pointer(top_logprobs),
                  np.int64(top_logprobs.stride if top_logprobs else 0), top_n)


def _check_logits(name: str, logits: DeviceTensor, params: DeviceTensor) -> tuple[int, int]:
    require(logits.dtype == "float32" and len(logits.shape) == 2, f"{name}: logits must be [N, V] float32")
    num_rows, vocab_size = logits.shape
    require(0 < vocab_size <= MAX_VOCAB, f"{name}: vocabulary {vocab_size} must be in [1, {MAX_VOCAB}]")
    require(logits.ptr % 4 == 0, f"{name}: logits must be 4-byte aligned")
    require(params.dtype == "int32" and params.shape == (num_rows, PARAM_WORDS) and params.is_contiguous,
            f"{name}: params must be [{num_rows}, {PARAM_WORDS}] int32 (pack_sampling_params), not {params.shape}")
    require(params.ptr % 8 == 0, f"{name}: params must be 8-byte aligned")
    return num_rows, vocab_size


def _pointer(tensor: DeviceTensor | None):
    return NULL if tensor is None or tensor.numel == 0 else tensor
