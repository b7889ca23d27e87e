"""A BeamGenerate call's search on the device (runtime/beam/on_device.py): its state laid out in the stream's beam
state region (cuda_kernels/beam_state.cuh), and a step as kernel launches: select, fork, the KV copies, then the
next decode forward (a graph replay where a bucket fits) with its metadata and candidates written by kernels
from the state. The host reads the hypotheses once at the end.

The host runs a step ahead of the device: each step's done flags come back asynchronously, and the host reads
them one step later, after queueing the next step. So the device never waits for the host's launches (a graph
launch takes ~0.1 ms of host time), and a request that ended runs one more step as padding (its rows read and
write nothing) before it leaves the forward. A request that reaches max_new_tokens is known to end without its
flag, so the last step queues no forward."""

import math
import numpy as np

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.batch import pack_batch, padded_rows
from metrale.runtime.backend.cuda.device import ALIGNMENT, Arena
from metrale.runtime.backend.cuda.graphs import empty_decode_batch
from metrale.runtime.backend.cuda.stream_context import StreamCandidates
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.beam.on_device import SearchStart
from metrale.runtime.errors import DeviceFault

# beam_state.cuh's BeamState, field by field (8 bytes each): sizes, then arrays (name, dtype, shape of the search).
SIZES = ("num_requests", "total_beams", "max_len", "table_width", "keep_stride", "num_eos", "block_size",
         "max_blocks", "divisor_stride")
ARRAYS = ("num_beams", "beam_base", "prompt_len", "max_length", "min_new", "ngram", "early_stopping", "best_length",
          "source_len", "cross_tables", "divisors", "eos", "done", "improvable", "result_parity", "fault",
          "beam_request", "running", "running_scores", "tables", "sequences", "scores", "lengths", "finished",
          "parents", "cand_ids", "cand_values", "copies", "block_ids", "holders", "free_stack", "free_top",
          "rows_beam", "active")
FLOAT_ARRAYS = {"divisors", "running_scores", "scores", "cand_values"}
NEG = -1.0e9
# The step kernels' limits (beam_step.cu): a request's candidates (num_beams x keep) and the continuations it keeps.
MAX_CANDIDATES = 4096
MAX_KEEP = 256
MAX_BEAMS = 32                 # beam_step.cu's per-request arrays (MAX_SELECT_BEAMS)


def fits(search: SearchStart) -> bool:
    """Whether every request's search fits the step kernels' arrays. A request keeps a multiple of its num_beams
    (BeamGroup.keep: the same factor for all, the EOS ids being the call's), so the widest request keeps
    keep_stride, and it alone need be checked."""
    beams, keep = int(search.num_beams.max()), search.keep_stride
    return beams <= MAX_BEAMS and keep <= MAX_KEEP and keep * beams <= MAX_CANDIDATES


def seed_of(search: SearchStart, ctx) -> StreamCandidates | None:
    """The stream's candidates every request's prompt row is in, while its buffer still holds them (beam_seed copies
    them into the state on the device); None where they came from several forwards, or from elsewhere: the host
    reads them (state_arrays)."""
    found = search.prompt_candidates[0][0]
    one = all(candidates is found for candidates, _ in search.prompt_candidates)
    return found if one and isinstance(found, StreamCandidates) and found.ctx is ctx and found.on_device else None


def state_arrays(s: SearchStart, max_blocks: int, seeded: bool = False) -> dict[str, np.ndarray]:
    """Every array of the state at the start of the search (both halves of the double-buffered ones). seeded: the
    first candidates come from the device (beam_seed, by the extra array seed_rows: each beam's row there), not
    from the host."""
    R, TB, L, W = len(s.num_beams), len(s.tables), s.max_len, s.table_width
    beam_request = np.repeat(np.arange(R, dtype=np.int32), s.num_beams)
    running = np.broadcast_to(padded_rows(s.prompts, L)[beam_request], (2, TB, L)).copy()
    running_scores = np.full((2, TB), NEG, dtype=np.float32)
    running_scores[:, s.beam_base] = 0.0
    tables = np.broadcast_to(padded_rows(s.tables, W), (2, TB, W)).copy()
    cross = padded_rows(s.cross_tables, max_blocks)
    free_stack = np.zeros(len(s.block_ids), dtype=np.int32)
    free_stack[:len(s.free)] = s.free
    zeros = lambda *shape: np.zeros(shape, dtype=np.int32)
    if seeded:
        cand_values, cand_ids = np.zeros((TB, s.keep_stride), dtype=np.float32), zeros(TB, s.keep_stride)
    else:
        cand_values, cand_ids = s.candidate_arrays()
    arrays = {
        "num_beams": s.num_beams, "beam_base": s.beam_base, "prompt_len": s.prompt_len, "max_length": s.max_length,
        "min_new": s.min_new, "ngram": s.ngram, "early_stopping": s.early_stopping, "best_length": s.best_length,
        "source_len": s.source_len, "cross_tables": cross, "divisors": s.divisors, "eos": s.eos,
        # done, then the fault flag: one copy back a step reads both
        "done": zeros(R + 1), "improvable": np.ones(R, dtype=np.int32), "result_parity": zeros(R),
        "beam_request": beam_request, "running": running, "running_scores": running_scores, "tables": tables,
        "sequences": running.copy(), "scores": np.full((2, TB), NEG, dtype=np.float32), "lengths": zeros(2, TB),
        "finished": zeros(2, TB), "parents": zeros(TB), "cand_ids": cand_ids, "cand_values": cand_values,
        "copies": zeros(TB, 3), "block_ids": s.block_ids, "holders": s.holders, "free_stack": free_stack,
        "free_top": np.array([len(s.free)], dtype=np.int32), "rows_beam": np.arange(TB, dtype=np.int32),
        "active": np.arange(R, dtype=np.int32),
    }
    if seeded:
        arrays["seed_rows"] = np.repeat(np.array([row for _, row in s.prompt_candidates], dtype=np.int32),
                                        s.num_beams)
    return arrays


class CudaDeviceSearch:
    """DeviceSearch on one stream. forward(batch): the model's decode forward (its ops read the stream's prepared
    metadata); kv_cache: the pool's layers, for the KV copies."""

    def __init__(self, ctx, search: SearchStart, arrays: dict[str, np.ndarray], forward, kv_cache: list,
                 region: DeviceTensor, seed: StreamCandidates | None = None):
        """arrays: state_arrays(search, ..., seeded=seed is not None), which state_bytes() sized the region for;
        seed: seed_of(search, ctx)."""
        self.ctx, self.lib, self.forward, self.kv_cache = ctx, ctx.lib, forward, kv_cache
        self.search = search
        arena = Arena(region.ptr, region.nbytes, "beam state")
        header = arena.take((len(SIZES) + len(ARRAYS),), "int64")
        self.views = {name: arena.take(a.shape, "float32" if name in FLOAT_ARRAYS else "int32")
                      for name, a in arrays.items()}
        sizes = dict(num_requests=len(search.num_beams), total_beams=len(search.tables), max_len=search.max_len,
                     table_width=search.table_width, keep_stride=search.keep_stride, num_eos=len(search.eos),
                     block_size=search.block_size, max_blocks=ctx.shapes.max_blocks_per_seq,
                     divisor_stride=search.divisors.shape[1])
        pointers = {name: view.ptr for name, view in self.views.items()}
        pointers["fault"] = pointers["done"] + 4 * sizes["num_requests"]
        fields = [sizes[n] for n in SIZES] + [pointers[n] for n in ARRAYS]      # seed_rows is not the kernels'
        self.state = header.ptr
        self._upload(region, arena.used, [(header, np.array(fields, dtype=np.uint64).view(np.int64))]
                     + [(self.views[name], array) for name, array in arrays.items()])
        self.seeded = seed is not None
        if seed is not None:
            kernels.beam_step.beam_seed(self.lib, ctx.stream, self.views["cand_ids"], self.views["cand_values"],
                                        seed.ids, seed.values, self.views["seed_rows"])
            seed.release()
        self.parity, self.generated = 0, 0
        self.num_requests, self.total_beams = sizes["num_requests"], sizes["total_beams"]
        self.active = list(range(self.num_requests))
        self.max_new = (search.max_length - search.prompt_len).tolist()
        self.rows, self._going = self.total_beams, self.num_requests     # forward rows, and their requests
        self.searching = True
        self._results: dict[str, np.ndarray] | None = None
        self._flags = None            # the last step's (event, pinned done flags), read after the next is queued
        self.scratch = {name: arena.take(shape, dtype) for name, (shape, dtype) in scratch(self.total_beams).items()}

    def _upload(self, region: DeviceTensor, used: int, parts: list[tuple[DeviceTensor, np.ndarray]]) -> None:
        """The header and every array, laid out in one host buffer as the arena placed them: one copy."""
        image = np.zeros(-(-used // 4), dtype=np.int32)
        raw = image.view(np.uint8)
        for view, array in parts:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            offset = view.ptr - region.ptr
            raw[offset:offset + data.size] = data
        self.ctx.copy_to_device(DeviceTensor(region.ptr, image.shape, "int32"), image)

    def copy(self, dst: DeviceTensor, host: np.ndarray) -> None:
        """host (4- or 8-byte elements) into dst's first bytes, queued on the stream."""
        host = np.ascontiguousarray(host).reshape(-1)
        if not host.size:
            return
        words = host.view(np.int32 if host.itemsize == 4 else np.int64)
        self.ctx.copy_to_device(DeviceTensor(dst.ptr, words.shape, "int32" if host.itemsize == 4 else "int64"), words)

    def step(self) -> None:
        """One search step: select, fork and copy; then, while requests may search on, the next forward and its
        candidates."""
        ctx, lib, stream = self.ctx, self.lib, self.ctx.stream
        kernels.beam_step.beam_select(lib, stream, self.state, len(self.active), self.parity, self.generated)
        flags, flags_address = ctx.beam_flags_half(self.generated % 2, self.num_requests + 1)
        kernels.beam_step.beam_fork(lib, stream, self.state, len(self.active), self.parity, self.generated,
                                    flags_address)
        kernels.rope_kv.copy_prefixes(lib, stream, self.kv_cache, self.views["copies"], self.total_beams)
        last, self._flags = self._flags, (stream.record(), flags)
        self.parity, self.generated = 1 - self.parity, self.generated + 1
        # Requests that may search on: not known to have ended (the step before's flags), not at max_new_tokens.
        known = self._read(last) if last else np.zeros(self.num_requests + 1, dtype=np.int32)
        going = [r for r in self.active if not known[r] and self.generated < self.max_new[r]]
        if not going:
            self._read(self._flags)         # this step's faults
            self.searching = False
            return
        self._leave([r for r in self.active if not known[r]], going)
        logits = self._forward()
        kernels.beam.beam_state_candidates(lib, stream, logits, self.state, self.rows, self.parity, self.generated,
                                           self.search.keep_stride, self.scratch)

    def _read(self, flags) -> np.ndarray:
        event, done = flags
        event.sync()
        if done[self.num_requests]:
            raise DeviceFault("a logits row has no finite maximum (NaN or +inf logits), or the call's KV blocks "
                              "ran out: no beam to continue")
        return done

    def _leave(self, active: list[int], going: list[int]) -> None:
        """Requests known to have ended leave the search's lists, and those that will have (max_new_tokens) the
        forward's rows."""
        s = self.search
        if len(active) < len(self.active):
            self.active = active
            self.copy(self.views["active"], np.asarray(active, dtype=np.int32))
        if len(going) != self._going:           # requests only ever leave
            rows = np.concatenate([np.arange(s.beam_base[r], s.beam_base[r] + s.num_beams[r]) for r in going])
            self.rows, self._going = len(rows), len(going)
            self.copy(self.views["rows_beam"], rows.astype(np.int32))

    def _forward(self) -> DeviceTensor:
        """The decode forward over the rows: its graph when a bucket fits, else run directly; logits [rows, V]."""
        ctx, graphs = self.ctx, self.ctx.graphs
        size = graphs.size_for(self.rows) if graphs else None
        if size:
            graphs.capture(self.forward, size)
            batch, cross = graphs.layout(size)
        else:
            batch, cross = self._layout(self.rows)
        kernels.beam_step.beam_metadata(self.lib, ctx.stream, self.state, self.parity, self.generated, self.rows,
                                        batch, cross)
        if size:
            return graphs.replay(size).rows(0, self.rows)
        ctx.ring.reset()
        with ctx.reuse_prepared(batch, cross):
            return self.forward(empty_decode_batch(self.search.encoder_decoder))

    def _layout(self, rows: int):
        """pack_batch's views for `rows` padded decode rows in the stream's metadata regions, attention planned for
        the longest context and source."""
        ctx, empty = self.ctx, empty_decode_batch(self.search.encoder_decoder)
        batch = pack_batch(empty, ctx.metadata, ctx.shapes.max_blocks_per_seq, pad_to=rows,
                           query_rows=ctx.shapes.index_topk > 0)
        batch.max_decode_context = self.search.max_len
        if not self.search.encoder_decoder:
            return batch, None
        cross = pack_batch(empty.cross, ctx.cross_metadata, ctx.shapes.max_blocks_per_seq, pad_to=rows)
        cross.max_decode_context = int(self.search.source_len.max())
        return batch, cross

    def hypotheses(self, request: int, count: int) -> list[tuple[list[int], float]]:
        if self._results is None:
            self._results = {name: self.ctx.copy_to_host(self.views[name])
                             for name in ("sequences", "scores", "lengths", "result_parity")}
        res, s = self._results, self.search
        half, start = int(res["result_parity"][request]), int(s.prompt_len[request])
        L, TB, base = s.max_len, self.total_beams, int(s.beam_base[request])
        sequences = res["sequences"].reshape(2, TB, L)[half]
        scores = res["scores"].view(np.float32).reshape(2, TB)[half]
        lengths = res["lengths"].reshape(2, TB)[half]
        return [(sequences[base + i, start:start + int(lengths[base + i])].tolist(), float(scores[base + i]))
                for i in range(count)]


def state_bytes(arrays: dict[str, np.ndarray], total_beams: int) -> int:
    """The beam state region state_arrays' arrays need (each aligned as Arena places it, the header, the scratch)."""
    parts = [4 * math.prod(shape) * (2 if dtype == "int64" else 1) for shape, dtype in scratch(total_beams).values()]
    sizes = [8 * (len(SIZES) + len(ARRAYS))] + [a.nbytes for a in arrays.values()] + parts
    return sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes)


def scratch(total_beams: int) -> dict[str, tuple[tuple[int], str]]:
    """The split candidates' scratch (kernels.beam.beam_state_candidates), for every beam a row."""
    parts, merged = total_beams * kernels.beam.MAX_PARTS, total_beams * kernels.beam.MAX_MERGED
    return {"part_max": ((parts,), "float32"), "part_sum": ((parts,), "int64"), "part_ids": ((merged,), "int32"),
            "part_values": ((merged,), "float32")}
