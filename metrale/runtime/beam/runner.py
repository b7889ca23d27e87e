"""Runs the beam searches of one BeamGenerate call on the engine's model and KV pool.

All prompts are prefilled in as few forwards as max_batch_tokens allows; then each step is one decode forward over
the running beams of every request still searching, and a request leaves as soon as its search ends. Beams keep
their KV in paged blocks from a reservation taken out of the engine's pool at the start (enough for the worst
case, so a call never runs short half-way: it is refused with RESOURCE_EXHAUSTED instead) and all given back at
the end, whatever happens. Beams share the blocks of their common prefix by reference; when beams that share a
partly filled last block each append a token to it, all but one get a copy of the block's filled part first.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.beam.params import BeamRequest
from metrale.runtime.beam.search import BeamSearch
from metrale.runtime.errors import BatchTooLarge, Cancelled, OutOfRange
from metrale.runtime.kv_blocks import blocks_for
from metrale.runtime.planner import Limits
from metrale.runtime.sequence import BlockTable


@dataclass
class BeamResult:
    request_id: int
    # (generated tokens, score), best first.
    hypotheses: list[tuple[list[int], float]]


class BlockPool:
    """The blocks reserved for one call, with reference counts."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self._free = list(reversed(ids))
        self._refs: dict[int, int] = {}

    def take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                self._free.append(block)

    def is_shared(self, block: int) -> bool:
        return self._refs[block] > 1


@dataclass
class _Search:
    request: BeamRequest
    search: BeamSearch
    # Each running beam's block ids (entries of one list may be shared with other beams).
    beams: list[list[int]]


def blocks_needed(request: BeamRequest, block_size: int) -> int:
    """The most blocks a request's beams hold at once: the prompt's, then each beam's own from the prompt's last
    (possibly shared, partly filled) block to its last position."""
    prompt = len(request.prompt_tokens) + len(request.decoder_prefix)
    total = prompt + request.params.max_new_tokens
    return blocks_for(prompt, block_size) + request.params.num_beams * (blocks_for(total, block_size)
                                                                        - prompt // block_size)


class BeamCall:
    """One call's beam searches, run by run() over a reservation of blocks. The engine gives the forward
    (segments -> float32 logits rows on the host) and the KV copy (copies of (src block, dst block, tokens))."""

    def __init__(self, requests: list[BeamRequest], limits: Limits, block_size: int,
                 forward: Callable[[list[Segment]], torch.Tensor], copy_kv: Callable[[list], None],
                 eos_token_ids: tuple[int, ...], fill_token: int):
        self.requests, self.limits, self.block_size = requests, limits, block_size
        self.forward, self.copy_kv = forward, copy_kv
        self.eos_token_ids, self.fill_token = eos_token_ids, fill_token
        self._check_limits()

    def run(self, pool: BlockPool, cancelled: Callable[[], bool]) -> list[BeamResult]:
        searches, logits = self._prefill(pool)
        results: dict[int, BeamResult] = {}
        while searches:
            if cancelled():
                raise Cancelled()
            running = []
            for s, rows in zip(searches, logits):
                parents = s.search.step(rows)
                if s.search.done:
                    for blocks in s.beams:
                        pool.release(blocks)
                    results[s.request.request_id] = BeamResult(s.request.request_id, s.search.hypotheses())
                else:
                    self._fork(pool, s, parents.tolist())
                    running.append(s)
            searches = running
            if searches:
                logits = self._decode(searches)
        return [results[r.request_id] for r in self.requests]

    def _check_limits(self) -> None:
        limits = self.limits
        for r in self.requests:
            length = len(r.prompt_tokens) + len(r.decoder_prefix) + r.params.max_new_tokens
            if length > limits.max_model_len:
                raise OutOfRange(f"request_id {r.request_id}: prompt and max_new_tokens make {length} tokens, over "
                                 f"max_model_len={limits.max_model_len}")
            prompt = len(r.prompt_tokens) + len(r.decoder_prefix)
            if prompt > limits.max_batch_tokens:
                raise BatchTooLarge(prompt, limits.max_batch_tokens)
        beams = sum(r.params.num_beams for r in self.requests)
        if beams > min(limits.max_seqs, limits.max_batch_tokens):
            raise BatchTooLarge(beams, min(limits.max_seqs, limits.max_batch_tokens), "max_seqs")

    def blocks_needed(self) -> int:
        return sum(blocks_needed(r, self.block_size) for r in self.requests)

    def _prefill(self, pool: BlockPool) -> tuple[list[_Search], list[torch.Tensor]]:
        """Every prompt once; each search starts with num_beams beams on the prompt's blocks and its last logits
        row repeated (transformers runs num_beams copies of the prompt: the same rows)."""
        searches, rows = [], []
        pending: list[tuple[BeamRequest, list[int], list[int]]] = []
        budget = self.limits.max_batch_tokens

        def flush():
            segments = [Segment(BlockTable(blocks), 0, prompt, True) for _, prompt, blocks in pending]
            rows.extend(self.forward(segments))
            pending.clear()

        for r in self.requests:
            prompt = list(r.prompt_tokens) + list(r.decoder_prefix)
            if pending and sum(len(p) for _, p, _ in pending) + len(prompt) > budget:
                flush()
            blocks = [pool.take() for _ in range(blocks_for(len(prompt), self.block_size))]
            pending.append((r, prompt, blocks))
            k = r.params.num_beams
            pool.share(blocks * (k - 1))
            search = BeamSearch(r.params, prompt, self.eos_token_ids, self.fill_token)
            searches.append(_Search(r, search, [blocks] * k))
        flush()
        return searches, [row[None].expand(s.search.num_beams, -1) for s, row in zip(searches, rows)]

    def _fork(self, pool: BlockPool, s: _Search, parents: list[int]) -> None:
        """The new running beams' blocks: each continues its parent's, and gets a block of its own where it writes
        its new token (position cur_len - 1) into a block another beam also holds, or starts a new one."""
        position = s.search.cur_len - 1
        index, offset = divmod(position, self.block_size)
        children = [list(s.beams[p]) for p in parents]
        for blocks in children:
            pool.share(blocks)
        for blocks in s.beams:
            pool.release(blocks)
        copies = []
        for blocks in children:
            if offset == 0:
                blocks.append(pool.take())
            elif pool.is_shared(blocks[index]):
                own = pool.take()
                copies.append((blocks[index], own, offset))
                pool.release([blocks[index]])
                blocks[index] = own
        if copies:
            self.copy_kv(copies)
        s.beams = children

    def _decode(self, searches: list[_Search]) -> list[torch.Tensor]:
        segments = []
        for s in searches:
            position = s.search.cur_len - 1
            tokens = s.search.tokens()[:, -1].tolist()
            segments.extend(Segment(BlockTable(blocks), position, (token,), True)
                            for blocks, token in zip(s.beams, tokens))
        logits = self.forward(segments)
        out, start = [], 0
        for s in searches:
            out.append(logits[start:start + s.search.num_beams])
            start += s.search.num_beams
        return out
