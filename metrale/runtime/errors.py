"""Typed domain errors; service/status.py maps each to one gRPC status code."""


class WorkerError(Exception):
    """Base of every error a request can cause. The message is for a person to act on."""


class InvalidArgument(WorkerError):
    """Malformed input: empty tokens, ids out of range, bad sampling values, ..."""


class UnknownSequence(WorkerError):
    def __init__(self, seq_ids):
        self.seq_ids = sorted(seq_ids)
        super().__init__(f"unknown seq_id(s) {self.seq_ids}: create a sequence with a chunk_start=0 slice first")


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
        super().__init__(f"seq_id(s) {self.seq_ids} are in another step that has not finished; "
                         f"send one step per sequence at a time")


class Draining(WorkerError):
    def __init__(self):
        super().__init__("the worker is shutting down and takes no new work")


class Cancelled(WorkerError):
    def __init__(self):
        super().__init__("the request was cancelled (or its deadline passed) before its step finished; "
                         "its sequences are as they were before it")


class DeviceFault(WorkerError):
    """The device failed mid-step; the worker stops serving."""
