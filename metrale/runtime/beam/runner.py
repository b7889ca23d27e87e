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
from metrale.runtime.beam.search import BeamGroup
from metrale.runtime.errors import BatchTooLarge, Cancelled, OutOfRange
from metrale.runtime.kv_blocks import KvBlockManager, blocks_for
from metrale.runtime.planner import Limits
from metrale.runtime.sequence import BlockTable


@dataclass
class BeamResult:
    request_id: int
    # (generated tokens, score), best first.
    hypotheses: list[tuple[list[int], float]]


@dataclass
class _Request:
    request: BeamRequest
    # Each running beam's block ids (entries of one list may be shared with other beams).
    beams: list[list[int]]
    # Encoder-decoder models: the blocks of the request's source's cross-attention K/V (shared by its beams, never
    # written after the encoder pass), and the source's length.
    cross_blocks: list[int] | None = None
    source_len: int = 0

    @property
    def cross(self) -> tuple[BlockTable, int] | None:
        return None if self.cross_blocks is None else (BlockTable(self.cross_blocks), self.source_len)


@dataclass
class _Group:
    """The requests of one num_beams, searched together; members follow the search's rows."""
    search: BeamGroup
    members: list[_Request]


@dataclass(frozen=True)
class BeamModel:
    """What a call needs of the model, given by the engine. forward(segments): float32 logits rows on the host;
    copy_kv(copies): (src block, dst block, tokens) KV copies; encode(segments): the encoder over source segments,
    writing their cross-attention K/V into the segments' blocks, and decoder_start the decoder's first token, for
    encoder-decoder models (None for decoder-only ones)."""
    forward: Callable[[list[Segment]], torch.Tensor]
    copy_kv: Callable[[list], None]
    eos_token_ids: tuple[int, ...]
    fill_token: int
    encode: Callable[[list[Segment]], None] | None = None
    decoder_start: int | None = None


def decoder_prompt(request: BeamRequest, model: BeamModel) -> list[int]:
    """The tokens before the first searched one: a decoder-only prompt and prefix, or an encoder-decoder's start
    token and prefix (transformers' decoder_input_ids)."""
    if model.decoder_start is not None:
        return [model.decoder_start, *request.decoder_prefix]
    return [*request.prompt_tokens, *request.decoder_prefix]


def blocks_needed(request: BeamRequest, prompt_len: int, block_size: int) -> int:
    """The most blocks a request holds at once: its source's cross blocks, the prompt's, then each beam's own from
    the prompt's last (possibly shared, partly filled) block to its last position."""
    params, source = request.params, len(request.src_tokens)
    total = prompt_len + params.max_new_tokens
    return (blocks_for(source, block_size) + blocks_for(prompt_len, block_size)
            + params.num_beams * (blocks_for(total, block_size) - prompt_len // block_size))


class BeamCall:
    """One call's beam searches, run by run() over a reservation of blocks."""

    def __init__(self, requests: list[BeamRequest], limits: Limits, block_size: int, model: BeamModel,
                 max_source_len: int):
        self.requests, self.limits, self.block_size, self.model = requests, limits, block_size, model
        self.prompts = [decoder_prompt(r, model) for r in requests]
        self._check_limits(max_source_len)

    def run(self, pool: KvBlockManager, cancelled: Callable[[], bool]) -> list[BeamResult]:
        groups, logits = self._prefill(pool, self._encode(pool))
        results: dict[int, BeamResult] = {}
        while groups:
            if cancelled():
                raise Cancelled()
            searching = []
            for group, rows in zip(groups, logits):
                parents, done = group.search.step(rows)
                going = []
                for i, member in enumerate(group.members):
                    if done[i]:
                        for blocks in member.beams + ([member.cross_blocks] if member.cross_blocks else []):
                            pool.free(blocks)
                        results[member.request.request_id] = BeamResult(member.request.request_id,
                                                                        group.search.hypotheses(i))
                    else:
                        self._fork(pool, member, parents[i].tolist(), int(group.search.cur_len[i]) - 1)
                        going.append(i)
                if going:
                    if len(going) < len(group.members):
                        group.search.keep_rows(going)
                        group.members = [group.members[i] for i in going]
                    searching.append(group)
            groups = searching
            if groups:
                logits = self._decode(groups)
        return [results[r.request_id] for r in self.requests]

    def _check_limits(self, max_source_len: int) -> None:
        limits = self.limits
        for r, prompt in zip(self.requests, self.prompts):
            length = len(prompt) + r.params.max_new_tokens
            if length > limits.max_model_len:
                raise OutOfRange(f"request_id {r.request_id}: prompt and max_new_tokens make {length} tokens, over "
                                 f"max_model_len={limits.max_model_len}")
            if len(r.src_tokens) > max_source_len:
                raise OutOfRange(f"request_id {r.request_id}: {len(r.src_tokens)} source tokens, over the encoder's "
                                 f"{max_source_len} positions")
            if len(prompt) > limits.max_batch_tokens:
                raise BatchTooLarge(len(prompt), limits.max_batch_tokens)
        sources = sum(len(r.src_tokens) for r in self.requests)
        if sources > limits.max_batch_tokens:
            raise BatchTooLarge(sources, limits.max_batch_tokens)
        beams = sum(r.params.num_beams for r in self.requests)
        if beams > min(limits.max_seqs, limits.max_batch_tokens):
            raise BatchTooLarge(beams, min(limits.max_seqs, limits.max_batch_tokens), "max_seqs")

    def blocks_needed(self) -> int:
        return sum(blocks_needed(r, len(p), self.block_size) for r, p in zip(self.requests, self.prompts))

    def _encode(self, pool: KvBlockManager) -> list[list[int] | None]:
        """Encoder-decoder models: every source through the encoder at once, its cross-attention K/V into blocks
        of its own; the blocks of each request (None for decoder-only models)."""
        if self.model.encode is None:
            return [None] * len(self.requests)
        cross = [pool.allocate(blocks_for(len(r.src_tokens), self.block_size)) for r in self.requests]
        self.model.encode([Segment(BlockTable(blocks), 0, r.src_tokens, False)
                           for r, blocks in zip(self.requests, cross)])
        return cross

    def _prefill(self, pool: KvBlockManager, cross: list[list[int] | None]) -> tuple[list[_Group], list[torch.Tensor]]:
        """Every prompt once; each request starts with num_beams beams on the prompt's blocks and its last logits
        row repeated (transformers runs num_beams copies of the prompt: the same rows). Requests are grouped by
        num_beams, in call order."""
        members, rows = [], []
        pending: list[tuple[list[int], list[int], _Request]] = []
        budget, m = self.limits.max_batch_tokens, self.model

        def flush():
            rows.extend(m.forward([Segment(BlockTable(blocks), 0, prompt, True, member.cross)
                                   for prompt, blocks, member in pending]))
            pending.clear()

        for r, prompt, cross_blocks in zip(self.requests, self.prompts, cross):
            if pending and sum(len(p) for p, _, _ in pending) + len(prompt) > budget:
                flush()
            blocks = pool.allocate(blocks_for(len(prompt), self.block_size))
            pool.share(blocks * (r.params.num_beams - 1))
            members.append(_Request(r, [blocks] * r.params.num_beams, cross_blocks, len(r.src_tokens)))
            pending.append((prompt, blocks, members[-1]))
        flush()
        by_beams: dict[int, list[int]] = {}
        for i, r in enumerate(self.requests):
            by_beams.setdefault(r.params.num_beams, []).append(i)
        groups, logits = [], []
        for k, indices in by_beams.items():
            search = BeamGroup([self.requests[i].params for i in indices], [self.prompts[i] for i in indices],
                               m.eos_token_ids, m.fill_token)
            groups.append(_Group(search, [members[i] for i in indices]))
            logits.append(torch.stack([rows[i] for i in indices])[:, None].expand(-1, k, -1))
        return groups, logits

    def _fork(self, pool: KvBlockManager, member: _Request, parents: list[int], position: int) -> None:
        """The new running beams' blocks: each continues its parent's, and gets a block of its own where it writes
        its new token (at `position`) into a block another beam also holds, or starts a new one."""
        index, offset = divmod(position, self.block_size)
        children = [list(member.beams[p]) for p in parents]
        for blocks in children:
            pool.share(blocks)
        for blocks in member.beams:
            pool.free(blocks)
        copies = []
        for blocks in children:
            if offset == 0:
                blocks.extend(pool.allocate(1))
            elif pool.is_shared(blocks[index]):
                own = pool.allocate(1)[0]
                copies.append((blocks[index], own, offset))
                pool.free([blocks[index]])
                blocks[index] = own
        if copies:
            self.model.copy_kv(copies)
        member.beams = children

    def _decode(self, groups: list[_Group]) -> list[torch.Tensor]:
        """One forward over every running beam; logits [requests, beams, vocab] per group."""
        segments = []
        for group in groups:
            tokens, positions = group.search.last_tokens().tolist(), (group.search.cur_len - 1).tolist()
            for member, row, position in zip(group.members, tokens, positions):
                cross = member.cross
                segments.extend(Segment(BlockTable(blocks), position, (token,), True, cross)
                                for blocks, token in zip(member.beams, row))
        logits = self.model.forward(segments)
        out, start = [], 0
        for group in groups:
            n, k = len(group.members), group.search.num_beams
            out.append(logits[start:start + n * k].view(n, k, -1))
            start += n * k
        return out
