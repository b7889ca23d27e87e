"""Sampling on the device: the sampler kernels over a stream's logits (the LM head's bf16 rows widened to float32, as
transformers widens them), one small copy back (tokens, logprobs, top-n), and full logits rows only for the
sequences that asked."""

import math

import numpy as np
import torch

from metrale.runtime.backend.cuda.kernels import sampling as kernels
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import DeviceFault
from metrale.runtime.sampling import MAX_TOP_LOGPROBS, SampleResult

# Words per row of the output region: token, logprob, top-n ids, top-n logprobs.
OUT_WORDS = 2 + 2 * MAX_TOP_LOGPROBS


class DeviceSampler:
    def __init__(self, ctx, params: DeviceTensor, widened: DeviceTensor, processed: DeviceTensor,
                 outputs: DeviceTensor):
        """ctx: the StreamContext whose stream it runs on (its lists region takes the penalty lists); params
        [max_seqs, PARAM_WORDS] int32; widened and processed [max_seqs, vocab] float32; outputs
        [max_seqs * OUT_WORDS] int32."""
        self.ctx, self.params = ctx, params
        self.widened, self.processed, self.outputs = widened, processed, outputs
        # pack_sampling_params's packed (params, options) pairs: a sequence's are the same objects at every step.
        self.packed_pairs: dict = {}

    def queue(self, bf16_logits: DeviceTensor, rows) -> "QueuedRows":
        """Queues the sampling of bf16_logits [len(rows), V] (the LM head's output rows) on the stream; the
        outputs stay in the stream's outputs region until the answer's result() reads them back."""
        ctx, lib, stream = self.ctx, self.ctx.lib, self.ctx.stream
        n = len(rows)
        logits = self.widened.rows(0, n)
        kernels.widen_rows(lib, stream, logits, bf16_logits)
        host_params = kernels.pack_sampling_params(rows, self.packed_pairs)
        params = DeviceTensor(self.params.ptr, host_params.shape, "int32")
        ctx.copy_to_device(params, host_params)
        processed = None
        if any(row.params.has_penalties for row in rows):
            processed = self.processed.rows(0, n)
            lists = kernels.pack_penalties(rows, logits.shape[1])
            offsets, entries, biases = ctx.upload_lists([lists.entry_offsets, lists.entries, lists.biases],
                                                         "the penalty lists")
            kernels.apply_penalties(lib, stream, processed, logits, params, offsets, entries, biases)
        wanted = Wanted(rows)
        top_n = max((k for _, k in wanted.top), default=0)
        base = self.outputs.ptr
        tokens = DeviceTensor(base, (n,), "int32")
        logprobs = DeviceTensor(base + 4 * n, (n,), "float32")
        top_ids = DeviceTensor(base + 8 * n, (n, MAX_TOP_LOGPROBS), "int32")
        top_logprobs = DeviceTensor(base + 8 * n + 4 * n * MAX_TOP_LOGPROBS, (n, MAX_TOP_LOGPROBS), "float32")
        kernels.sample_rows(lib, stream, logits, params, tokens, logprobs, top_ids, top_logprobs, top_n,
                            processed=processed)
        ctx.mark_sampled()
        return QueuedRows(self, logits, wanted)

    def result(self, queued: "QueuedRows") -> SampleResult:
        """Waits for the stream, then reads the outputs region (and the logits rows asked for) back."""
        wanted = queued.wanted
        result = read_outputs(self.ctx.copy_to_host(DeviceTensor(self.outputs.ptr, (wanted.num_rows * OUT_WORDS,),
                                                                 "int32")), wanted)
        for i in wanted.raw:
            result.logits[i] = torch.from_numpy(self.ctx.copy_to_host(queued.logits.rows(i, i + 1))[0])
        return result


class Wanted:
    """What a sampling's rows asked for beside their tokens, read from their options when it is queued (while the
    device works), so that reading its result back is only the copy and its conversion: whether rows want their
    logprob (all, none, or each row's flag), the (row, n) of those asking for top-n, the rows asking for logits."""

    __slots__ = ("num_rows", "logprobs", "top", "raw")

    def __init__(self, rows):
        options = [row.options for row in rows]
        self.num_rows = len(options)
        flags = [o.logprobs for o in options]
        self.logprobs = True if all(flags) else False if not any(flags) else flags
        self.top = [(i, o.top_logprobs) for i, o in enumerate(options) if o.top_logprobs]
        self.raw = [i for i, o in enumerate(options) if o.return_logits]


def read_outputs(host: np.ndarray, wanted: Wanted) -> SampleResult:
    """The outputs region's image (int32 [num_rows * OUT_WORDS]: tokens, logprobs, top-n ids, top-n logprobs) as a
    SampleResult; logits rows None (the caller copies those it wants)."""
    n = wanted.num_rows
    tokens = host[:n].tolist()
    if (host[:n] < 0).any():
        raise DeviceFault("a logits row has no finite maximum (NaN or +inf logits): nothing to sample")
    if wanted.logprobs is False:
        logprobs = [math.nan] * n
    else:
        logprobs = host[n:2 * n].view(np.float32).tolist()
        if wanted.logprobs is not True:
            logprobs = [lp if flag else math.nan for lp, flag in zip(logprobs, wanted.logprobs)]
    top = [None] * n
    if wanted.top:
        ids = host[2 * n:2 * n + n * MAX_TOP_LOGPROBS].reshape(n, MAX_TOP_LOGPROBS)
        values = host[2 * n + n * MAX_TOP_LOGPROBS:].view(np.float32).reshape(n, MAX_TOP_LOGPROBS)
        for i, k in wanted.top:
            top[i] = (ids[i, :k].tolist(), values[i, :k].tolist())
    return SampleResult(tokens, logprobs, top, [None] * n)


class QueuedRows:
    """A stream's queued sampling (Runner.queue_sample's answer on CUDA): read back by result()."""

    __slots__ = ("sampler", "logits", "wanted")

    def __init__(self, sampler: DeviceSampler, logits: DeviceTensor, wanted: Wanted):
        self.sampler, self.logits, self.wanted = sampler, logits, wanted

    def result(self) -> SampleResult:
        return self.sampler.result(self)
