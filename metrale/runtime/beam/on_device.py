"""A call's search steps on the device, for backends that have them (Runner.device_search): each step the
backend selects every request's next beams, forks their KV blocks and runs the next decode forward and its
candidates without the host; the host launches the step and reads one done flag per request.

The search is the one BeamGroup does (search.py), kernel for kernel: the same float32 arithmetic in the same
order. The candidates' log-sum-exp is summed per part of the row and combined in float64, so a log-probability
can differ from the host path's in its last bit (docs/beam_on_device.md, Exactness). The prompt pass (encoder
and prefill) is the call's, as on the host; what it leaves (each request's beams on its prompt's blocks, their
first candidates where the backend computed them, the reservation's free blocks and holders) is handed over as one
SearchStart, without waiting for the device.
"""

import itertools
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from metrale.runtime.beam.candidates import Candidates, rows_of
from metrale.runtime.errors import Cancelled
from metrale.runtime.cache.blocks import BlockPool, blocks_for

EARLY_STOPPING_CODES = {False: 0, True: 1, "never": 2}


@dataclass
class SearchStart:
    """Where a call's search starts, as arrays: per request (R, in the order of `requests`), per beam (TB: request
    r's beams at beam_base[r] ..), per reserved block (B)."""
    num_beams: np.ndarray        # [R] int32
    beam_base: np.ndarray
    prompt_len: np.ndarray
    max_length: np.ndarray
    min_new: np.ndarray
    ngram: np.ndarray
    early_stopping: np.ndarray   # EARLY_STOPPING_CODES
    best_length: np.ndarray      # the can-improve test's length, -1: the steps so far
    source_len: np.ndarray
    prompts: list[list[int]]
    divisors: np.ndarray         # [R, longest max_new_tokens + 1] float32: length ** length_penalty, by length
    eos: np.ndarray              # int32
    cross_tables: list[list[int]]  # [R] pool ids (empty lists for decoder-only models)
    tables: list[list[int]]      # [TB] indices into block_ids
    block_ids: np.ndarray        # [B] pool ids
    holders: np.ndarray          # [B] int32
    free: np.ndarray             # indices into block_ids, the next one taken last
    # [R]: each request's prompt candidates, a row of one forward's (Candidates, row), the same for each of its beams;
    # keep_stride of them a row (the count the prompt pass asked every group for).
    prompt_candidates: list[tuple[Candidates, int]]
    keep_stride: int
    block_size: int
    max_len: int                 # the longest prompt_len + max_new_tokens
    table_width: int             # blocks_for(max_len)
    encoder_decoder: bool

    def candidate_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The prompt candidates on the host, once per beam: values [TB, keep_stride] float32, ids int32. Not
        checked: the device's first select refuses a row with a negative id or a NaN value."""
        values, ids = rows_of(self.prompt_candidates)
        return (np.repeat(values.numpy().astype(np.float32), self.num_beams, axis=0),
                np.repeat(ids.numpy().astype(np.int32), self.num_beams, axis=0))


class DeviceSearch(Protocol):
    searching: bool              # some request has not ended

    def step(self) -> None: ...

    def hypotheses(self, request: int, count: int) -> list[tuple[list[int], float]]: ...


class LockedDeviceSearch:
    """A search whose steps hold a lock (the engine's forward lock: a step's launches are one forward's)."""

    def __init__(self, search: DeviceSearch, lock):
        self.search, self.lock = search, lock

    @property
    def searching(self) -> bool:
        return self.search.searching

    def step(self) -> None:
        with self.lock:
            self.search.step()

    def hypotheses(self, request: int, count: int) -> list[tuple[list[int], float]]:
        with self.lock:
            return self.search.hypotheses(request, count)


def search_start(groups, pool: BlockPool, block_size: int, encoder_decoder: bool) -> tuple[SearchStart, list]:
    """The SearchStart the call's prompt pass leaves, and its requests (the groups' members, in order). Host
    work only: nothing here waits for the device."""
    members = [m for g in groups for m in g.members]
    searches = [(g.search, i) for g in groups for i in range(len(g.members))]
    k = np.array([s.num_beams for s, _ in searches], dtype=np.int32)
    params = [s.params[i] for s, i in searches]
    tokens = [row for g in groups for row in g.search.running[:, 0].numpy()]     # [R] rows: prompt, then fill
    prompt_len = np.concatenate([g.search.prompt_len.numpy() for g in groups]).astype(np.int32)
    max_new = np.array([p.max_new_tokens for p in params], dtype=np.int32)
    max_len = int((prompt_len + max_new).max())
    free, holders = pool.holders()
    beams = [beam for m in members for beam in m.beams]
    counts = [len(beam) for beam in beams]
    flat = pool.indices(np.fromiter(itertools.chain.from_iterable(beams), dtype=np.int64, count=sum(counts))).tolist()
    # Each request's length penalty divisors, float64 powers rounded to float32 (BeamGroup's), once per setting.
    divisors = np.ones((len(params), int(max_new.max()) + 1), dtype=np.float32)
    powers = {}
    for row, p in enumerate(params):
        setting = (p.max_new_tokens, p.length_penalty)
        if setting not in powers:
            powers[setting] = np.array([float(n) ** p.length_penalty for n in range(1, p.max_new_tokens + 1)],
                                       dtype=np.float64).astype(np.float32)
        divisors[row, 1:p.max_new_tokens + 1] = powers[setting]
    search = SearchStart(
        num_beams=k, beam_base=np.concatenate([[0], np.cumsum(k)[:-1]]).astype(np.int32), prompt_len=prompt_len,
        max_length=prompt_len + max_new, min_new=np.array([p.min_new_tokens for p in params], dtype=np.int32),
        ngram=np.array([p.no_repeat_ngram_size for p in params], dtype=np.int32),
        early_stopping=np.array([EARLY_STOPPING_CODES[p.early_stopping] for p in params], dtype=np.int32),
        best_length=np.array([p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0.0 else -1
                              for p in params], dtype=np.int32),
        source_len=np.array([m.source_len for m in members], dtype=np.int32),
        prompts=[row[:n].tolist() for row, n in zip(tokens, prompt_len.tolist())],
        divisors=divisors, eos=searches[0][0].eos.numpy().astype(np.int32),
        cross_tables=[list(m.cross_blocks or []) for m in members],
        tables=[flat[end - n:end] for end, n in zip(itertools.accumulate(counts), counts)],
        block_ids=np.asarray(pool.ids, dtype=np.int32), holders=holders, free=free,
        prompt_candidates=[m.prompt for m in members], keep_stride=max(g.search.keep for g in groups),
        block_size=block_size, max_len=max_len, table_width=blocks_for(max_len, block_size),
        encoder_decoder=encoder_decoder)
    return search, members


def run_device_search(search: DeviceSearch, members: list, cancelled: Callable[[], bool]) -> dict:
    """Steps until every request's search ended; request_id -> its hypotheses."""
    while search.searching:
        if cancelled():
            raise Cancelled()
        search.step()
    return {m.request.request_id: search.hypotheses(i, m.request.params.num_return_sequences)
            for i, m in enumerate(members)}

