"""DeepSeek sparse attention's choice of tokens on the CUDA backend (CudaLayerMath.sparse_select): every row of the
batch a query over its causal context (CudaBatch.row_contexts, row_tables), its index key written, its scores over
the cached index keys in pieces of rows that the stream's scores buffer holds, and its top-k positions kept in the
stream's selection buffers for the latent attention of this layer and of the layers that reuse it."""

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.batch import CudaBatch
from metrale.runtime.backend.cuda.stream_context import StreamContext
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.layer_math import RopeTable, SparseIndexer


class Selection:
    """Each row's chosen positions: by_row [T, width] int32 (ascending, then -1) and counts [T] int32; by entry of
    the decode kernel (decode_rows' order) once asked for."""

    def __init__(self, by_row: DeviceTensor, counts: DeviceTensor, width: int):
        self.by_row, self.counts, self.width = by_row, counts, width
        self._decode: tuple[DeviceTensor, DeviceTensor] | None = None

    def decode(self, lib, ctx: StreamContext, batch: CudaBatch) -> tuple[DeviceTensor, DeviceTensor]:
        """([B, width], [B]) of the batch's decode entries: in a batch of decode rows alone entry i is row i (a
        decode graph's, an eager decode step's), else their rows' selections gathered (int32 moved as float32
        words, unchanged)."""
        entries = batch.num_decode
        if not batch.num_prefill:
            return self.by_row.rows(0, entries), self.counts.rows(0, entries)
        if self._decode is None:
            selected = ctx.index["decode_selected"].rows(0, entries)
            counts = ctx.index["decode_counts"].rows(0, entries)
            kernels.embedding.gather_rows(lib, ctx.stream, _words(selected), _words(self.by_row),
                                          batch.decode_rows)
            by_row_counts = self.counts.view(self.counts.shape[0], 1)
            kernels.embedding.gather_rows(lib, ctx.stream, _words(counts), _words(by_row_counts), batch.decode_rows)
            self._decode = (selected, counts.view(entries))
        return self._decode


def select(lib, ctx: StreamContext, q: DeviceTensor, k: DeviceTensor, x: DeviceTensor, indexer: SparseIndexer,
           rope: RopeTable, batch: CudaBatch, cache: DeviceTensor) -> Selection:
    index, stream = kernels.sparse_index, ctx.stream
    tokens, block_size = q.shape[0], cache.shape[1]
    index.rope_and_write(lib, stream, q, k, rope.cos, rope.sin, batch.positions, batch.slot_mapping, cache,
                         indexer.num_heads, indexer.head_dim, indexer.rope_dim, indexer.rope_first)
    weights = ctx.index["weights"].rows(0, tokens)
    index.weights(lib, stream, weights, x, indexer.weights_proj, indexer.weight_scale)
    scores = ctx.index["scores"]
    piece, max_context = scores.shape
    selected, counts = ctx.index["selected"].rows(0, tokens), ctx.index["counts"].rows(0, tokens)
    kept = selected.shape[1]        # min(topk, the longest context): stream_buffers sizes the selection so
    for start in range(0, tokens, piece):
        stop = min(tokens, start + piece)
        contexts, part = batch.row_contexts.rows(start, stop), scores.rows(0, stop - start)
        index.scores(lib, stream, part, q, weights, cache, ctx.index["rows"].rows(start, stop), contexts,
                     batch.tables, batch.row_tables.rows(start, stop), block_size, max_context)
        index.top_k(lib, stream, selected.rows(start, stop), counts.rows(start, stop), part, contexts, kept)
    return Selection(selected, counts, kept)


def _words(tensor: DeviceTensor) -> DeviceTensor:
    """An int32 [rows, columns] tensor as float32 words (gather_rows moves them as they are)."""
    return DeviceTensor(tensor.ptr, tensor.shape, "float32", tensor.row_stride)
