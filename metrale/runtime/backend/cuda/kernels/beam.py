"""Launcher for cuda_kernels/beam.cu: each running beam's best continuations after transformers' processors, so a
beam search step copies back a few candidates per beam instead of its vocabulary-wide logits row."""

import numpy as np

from metrale.runtime.backend.cuda.kernels.sampling import MAX_VOCAB, THREADS
from metrale.runtime.backend.cuda.launch import launch_kernel, require
from metrale.runtime.backend.cuda.tensor import DeviceTensor

MODULE = "beam"
MAX_COUNT = THREADS            # top_logprobs_of ranks at most one candidate per thread
MERGE_THREADS = 256


def pack_banned(banned: list[list[int]]) -> list[np.ndarray]:
    """[N + 1] int32 offsets of each row's banned ids, and the ids [E] int32, as beam_candidates reads them."""
    offsets = np.cumsum([0] + [len(ids) for ids in banned]).astype(np.int32)
    return [offsets, np.asarray([i for ids in banned for i in ids], dtype=np.int32)]


def beam_candidates(lib, stream, logits: DeviceTensor, banned_offsets: DeviceTensor, banned: DeviceTensor,
                    ids_out: DeviceTensor, values_out: DeviceTensor) -> None:
    """ids_out [N, count] int32 and values_out [N, count] float32: the best `count` of each row of logits [N, V]
    bf16 (widened to float32) by log_softmax, with the row's banned ids at -inf, best first, ties to the lower id;
    ids -1 and NaN for a row with NaN or no finite maximum. logits is overwritten at the banned ids.
    banned_offsets [N + 1] int32 and banned [E] int32 (pack_banned)."""
    require(logits.dtype == "bfloat16" and len(logits.shape) == 2, "beam_candidates: logits must be [N, V] bf16")
    num_rows, vocab_size = logits.shape
    require(0 < vocab_size <= MAX_VOCAB, f"beam_candidates: vocabulary {vocab_size} must be in [1, {MAX_VOCAB}]")
    require(logits.ptr % 2 == 0, "beam_candidates: logits must be 2-byte aligned")
    require(ids_out.dtype == "int32" and values_out.dtype == "float32" and ids_out.is_contiguous
            and values_out.is_contiguous and len(ids_out.shape) == 2 and ids_out.shape == values_out.shape
            and ids_out.shape[0] == num_rows, f"beam_candidates: ids_out and values_out must be [{num_rows}, count] "
                                              f"int32 and float32, contiguous")
    count = ids_out.shape[1]
    require(0 < count <= min(MAX_COUNT, vocab_size), f"beam_candidates: count {count} must be in "
                                                     f"[1, {min(MAX_COUNT, vocab_size)}]")
    require(banned_offsets.dtype == "int32" and banned_offsets.shape == (num_rows + 1,),
            f"beam_candidates: banned_offsets must be [{num_rows + 1}] int32, not {banned_offsets.shape}")
    require(banned.dtype == "int32" and len(banned.shape) == 1, "beam_candidates: banned must be [E] int32")
    if num_rows == 0:
        return
    kernel = lib.get("beam_candidates", MODULE)
    launch_kernel(stream, kernel, num_rows, THREADS, logits, np.int64(logits.stride), vocab_size, banned_offsets,
                  banned if banned.numel else np.uint64(0), count, ids_out, values_out)


# The device search's split rows (beam.cu's beam_state_parts and beam_state_merge): enough parts per row to give
# the GPU about TARGET_BLOCKS blocks, at most MAX_PARTS, whose best `count` all fit the merge (MAX_MERGED).
TARGET_BLOCKS = 256
MAX_PARTS = 16
MAX_MERGED = 1024


def row_parts(rows: int, vocab_size: int, count: int) -> tuple[int, int]:
    """(parts, ids per part) for splitting `rows` bf16 logits rows: every part 16-byte aligned, and all but the last
    holding >= count ids (the kernel takes fewer from a short last part)."""
    parts = max(1, min(TARGET_BLOCKS // max(rows, 1), MAX_PARTS, MAX_MERGED // count, vocab_size // count))
    size = -(-vocab_size // parts)
    size = -(-size // 8) * 8
    if size < count:                    # a tiny vocabulary: one part
        return 1, vocab_size
    return -(-vocab_size // size), size


def beam_state_candidates(lib, stream, logits: DeviceTensor, state: int, num_rows: int, parity: int, generated: int,
                          count: int, scratch: dict[str, DeviceTensor]) -> None:
    """The device search's candidates (beam_step.cu's state at address `state`: `count` = its keep_stride best
    per beam), from rows [0, num_rows) of logits [>= num_rows, V] bf16, each beam's bans computed from its tokens.
    scratch: part_max [>= rows * MAX_PARTS] float32, part_sum (float64, as int64), part_ids and part_values
    [>= rows * MAX_MERGED] int32 and float32."""
    require(logits.dtype == "bfloat16" and len(logits.shape) == 2 and logits.shape[0] >= num_rows
            and logits.ptr % 16 == 0 and logits.stride % 8 == 0,
            "beam_state_candidates: logits must be [>= rows, V] bf16, rows 16-byte aligned")
    vocab_size = logits.shape[1]
    require(0 < vocab_size <= MAX_VOCAB, f"beam_state_candidates: vocabulary must be in [1, {MAX_VOCAB}]")
    require(0 < count <= min(MAX_COUNT, vocab_size), f"beam_state_candidates: count {count} must be in "
                                                     f"[1, {min(MAX_COUNT, vocab_size)}]")
    require(scratch["part_max"].numel >= num_rows * MAX_PARTS and scratch["part_ids"].numel >= num_rows * MAX_MERGED,
            "beam_state_candidates: scratch too small")
    if num_rows == 0:
        return
    parts, size = row_parts(num_rows, vocab_size, count)
    launch_kernel(stream, lib.get("beam_state_parts", MODULE), (num_rows, parts), THREADS, logits,
                  np.int64(logits.stride), vocab_size, np.uint64(state), parity, generated, size, count,
                  scratch["part_max"], scratch["part_sum"], scratch["part_ids"], scratch["part_values"])
    launch_kernel(stream, lib.get("beam_state_merge", MODULE), num_rows, MERGE_THREADS, logits,
                  np.int64(logits.stride), vocab_size, np.uint64(state), parts, count, scratch["part_max"],
                  scratch["part_sum"], scratch["part_ids"])
