"""Typed domain errors; service/status.py maps each to one gRPC status code."""

# Ids a message or log field names before it gives only the count: a request may carry millions.
NAMED_IDS = 8


def name_ids(ids) -> str:
    """The first NAMED_IDS ids, with the count where there are more: '[1, 2]', or '[1, 2, ...] (9 in all)'."""
    ids = list(ids)
    if len(ids) <= NAMED_IDS:
        return str(ids)
    return f"[{', '.join(map(str, ids[:NAMED_IDS]))}, ...] ({len(ids)} in all)"


def describe(error: BaseException, limit: int = 300) -> str:
    """An unexpected exception's repr for a message, cut to limit characters."""
    text = repr(error)
    return text if len(text) <= limit else text[:limit] + "..."


class WorkerError(Exception):
    """Base of every error a request can cause. The message is for a person to act on."""


class InvalidArgument(WorkerError):
    """Malformed input: empty tokens, ids out of range, bad sampling values, ..."""


class UnknownSequence(WorkerError):
    def __init__(self, seq_ids):
        self.seq_ids = sorted(seq_ids)
        super().__init__(f"unknown seq_id(s) {name_ids(self.seq_ids)}: create a sequence with a chunk_start=0 "
                         f"slice first")


class FailedPrecondition(WorkerError):
    """The request is well formed but the model or the sequence's state does not allow it."""


class OutOfRange(WorkerError):
    """A sequence would pass max_model_len."""


class OutOfKvBlocks(WorkerError):
    def __init__(self, blocks_needed: int, blocks_free: int):
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free
        super().__init__(f"not enough free KV blocks: this request needs {blocks_needed}, "
                         f"{blocks_free} are free; release sequences or send fewer tokens")


class OutOfStateSlots(WorkerError):
    """No free slot for a recurrent layer's state: each live sequence of such a model holds one, and each sequence
    a step advances one more until the step is done (the one before is its snapshot)."""

    def __init__(self, slots_needed: int, slots_free: int):
        self.slots_needed, self.slots_free = slots_needed, slots_free
        super().__init__(f"not enough free recurrent-state slots: this request needs {slots_needed}, "
                         f"{slots_free} are free; release sequences or send fewer")


class BatchTooLarge(WorkerError):
    """One forward over a limit of the memory plan: max_batch_tokens or max_seqs."""

    def __init__(self, count: int, limit: int, limit_name: str = "max_batch_tokens"):
        self.count, self.limit, self.limit_name = count, limit, limit_name
        what = "tokens" if limit_name == "max_batch_tokens" else "sequences"
        super().__init__(f"one step would run {count} {what} in a forward, over {limit_name}={limit}; "
                         f"split the prompt (chunk_size) or send fewer slices")


class SequenceBusy(WorkerError):
    def __init__(self, seq_ids):
        self.seq_ids = sorted(seq_ids)
        super().__init__(f"seq_id(s) {name_ids(self.seq_ids)} are in another step that has not finished; "
                         f"send one step per sequence at a time")


class Draining(WorkerError):
    def __init__(self):
        super().__init__("the worker is shutting down and takes no new work")


class Cancelled(WorkerError):
    def __init__(self):
        super().__init__("the request was cancelled (or its deadline passed) before its step finished; "
                         "its sequences are as they were before it")


class ListsTooLarge(WorkerError):
    """A step's per-row lists (penalised and biased ids, a beam step's banned ids) past the region the memory plan
    keeps for them; the step is undone."""

    def __init__(self, what: str, words: int, limit: int):
        self.words, self.limit = words, limit
        super().__init__(f"{what} take {words} words, over the {limit} the step's lists region holds; send fewer "
                         f"sequences with penalties or logit_bias (or fewer beams) per step; nothing was changed")


class ReplyTooLarge(WorkerError):
    """The answer would not fit in one gRPC message; the step is not committed."""

    def __init__(self, reply_bytes: int, limit_bytes: int, exact: bool = True):
        self.reply_bytes, self.limit_bytes = reply_bytes, limit_bytes
        size = f"{reply_bytes} bytes" if exact else f"at least {reply_bytes} bytes (the logits rows alone)"
        super().__init__(f"the answer would be {size}, over the largest message of {limit_bytes} bytes "
                         f"(--max-message-mb); ask return_logits of fewer sequences per step; nothing was changed")


class StepFailed(WorkerError):
    """An unexpected error (a bug, not the device) failed one call; what the call changed was undone and the worker
    serves on."""


class CollectiveFailed(StepFailed):
    """A tensor-parallel forward's collective broke off (another rank's part of the call failed, or this rank left
    it); the ranks start new collectives together and the worker serves on (a rank that cannot be reached is
    RankLost)."""


class DeviceFault(WorkerError):
    """The device itself failed (a driver or library status, a kernel's fault flag); the worker stops serving."""


class RankLost(DeviceFault):
    """A rank of a tensor-parallel worker died or hung past its collectives' timeout: the worker stops serving, and
    the call may be retried on another worker (UNAVAILABLE)."""


class Overloaded(WorkerError):
    """More forward calls in flight than --max-concurrent-rpcs allows."""

    def __init__(self, in_flight: int, limit: int):
        self.in_flight, self.limit = in_flight, limit
        super().__init__(f"{in_flight} forward calls are in flight, the most --max-concurrent-rpcs={limit} allows; "
                         f"retry after one finishes")


class ModelLoadError(WorkerError):
    """The model's files would not load: empty, truncated, corrupt, or not a checkpoint at all."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        super().__init__(f"cannot load the model {self.path}: {problem}")
