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

    def sample(self, bf16_logits: DeviceTensor, rows, on_queued=None) -> SampleResult:
        """bf16_logits [len(rows), V]: the LM head's output rows."""
        ctx, lib, stream = self.ctx, self.ctx.lib, self.ctx.stream
        n = len(rows)
        logits = self.widened.rows(0, n)
        kernels.widen_rows(lib, stream, logits, bf16_logits)
        host_params = kernels.pack_sampling_params(rows)
        params = DeviceTensor(self.params.ptr, host_params.shape, "int32")
        ctx.copy_to_device(params, host_params)
        processed = None
        if any(row.params.has_penalties for row in rows):
            processed = self.processed.rows(0, n)
            lists = kernels.pack_penalties(rows, logits.shape[1])
            offsets, entries, biases = ctx.upload_lists([lists.entry_offsets, lists.entries, lists.biases],
                                                         "the penalty lists")
            kernels.apply_penalties(lib, stream, processed, logits, params, offsets, entries, biases)
        top_n = max(row.options.top_logprobs for row in rows)
        base = self.outputs.ptr
        tokens = DeviceTensor(base, (n,), "int32")
        logprobs = DeviceTensor(base + 4 * n, (n,), "float32")
        top_ids = DeviceTensor(base + 8 * n, (n, MAX_TOP_LOGPROBS), "int32")
        top_logprobs = DeviceTensor(base + 8 * n + 4 * n * MAX_TOP_LOGPROBS, (n, MAX_TOP_LOGPROBS), "float32")
        kernels.sample_rows(lib, stream, logits, params, tokens, logprobs, top_ids, top_logprobs, top_n,
                            processed=processed)
        ctx.mark_sampled()
        if on_queued is not None:
            on_queued()
        host = ctx.copy_to_host(DeviceTensor(base, (n * OUT_WORDS,), "int32"))
        return self._result(host, logits, rows, top_n)

    def _result(self, host: np.ndarray, logits: DeviceTensor, rows, top_n: int) -> SampleResult:
        n = len(rows)
        tokens = host[:n].tolist()
        if any(t < 0 for t in tokens):
            raise DeviceFault("a logits row has no finite maximum (NaN or +inf logits): nothing to sample")
        logprobs = host[n:2 * n].view(np.float32).tolist()
        ids = host[2 * n:2 * n + n * MAX_TOP_LOGPROBS].reshape(n, MAX_TOP_LOGPROBS)
        values = host[2 * n + n * MAX_TOP_LOGPROBS:].view(np.float32).reshape(n, MAX_TOP_LOGPROBS)
        top, raw = [], []
        for i, row in enumerate(rows):
            k = row.options.top_logprobs
            top.append((ids[i, :k].tolist(), values[i, :k].tolist()) if k else None)
            raw.append(torch.from_numpy(self.ctx.copy_to_host(logits.rows(i, i + 1))[0])
                       if row.options.return_logits else None)
        logprobs = [lp if row.options.logprobs else math.nan for lp, row in zip(logprobs, rows)]
        return SampleResult(tokens, logprobs, top, raw)
