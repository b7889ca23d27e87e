"""Runs the beam searches of one BeamGenerate call on the engine's model and KV pool.

All prompts are prefilled in as few forwards as max_batch_tokens allows; then each step is one decode forward over
the running beams of every request still searching, and a request leaves as soon as its search ends. Beams keep
their KV in paged blocks from a reservation taken out of the engine's pool at the start (enough for the worst
case, so a call never runs short half-way: it is refused with RESOURCE_EXHAUSTED instead) and all given back at
the end, whatever happens. Beams share the blocks of their common prefix by reference; when beams that share a
partly filled last block each append a token to it, all but one get a copy of the block's filled part first.
A model with recurrent layers gives each request two sets of num_beams state slots, reserved with the blocks: a
step's beams read their parents' states from the set the step before wrote, and write theirs into the other, so
beams that continue one parent need no copy.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from metrale.runtime.batch import ForwardBatch, Segment, build_batch, build_decode_batch
from metrale.runtime.beam.candidates import Candidates, finite, rows_of
from metrale.runtime.beam.on_device import SearchStart, DeviceSearch, search_start, run_device_search
from metrale.runtime.beam.params import MAX_KEEP, BeamRequest
from metrale.runtime.beam.search import BeamGroup
from metrale.runtime.errors import BatchTooLarge, Cancelled, InvalidArgument, OutOfRange
from metrale.runtime.cache.blocks import BlockPool, blocks_for
from metrale.runtime.planner import Limits
from metrale.runtime.sequence import BlockTable


# The longest prompts a backend with decode graphs runs a token a forward (BeamModel.short_prompt): an NLLB
# prompt is the decoder start token and the target language's.
SHORT_PROMPT = 4


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
    # The candidates of the prompt's last token: a row of one forward's (left where the backend computed them).
    prompt: tuple[Candidates, int] | None = None
    # Models with recurrent layers: the request's two sets of num_beams state slots, the slot holding each running
    # beam's state, the set the next forward writes (0 or 1), and the slot each beam of that forward reads.
    state_sets: tuple[list[int], list[int]] | None = None
    beam_states: list[int] | None = None
    writes: int = 1
    sources: list[int] | None = None

    def __post_init__(self):
        # What each of its beams' segments carries (built once: the blocks never change).
        self.cross = None if self.cross_blocks is None else (BlockTable(self.cross_blocks), self.source_len)


@dataclass
class _Group:
    """The requests of one num_beams, searched together; members follow the search's rows."""
    search: BeamGroup
    members: list[_Request]


@dataclass(frozen=True)
class BeamModel:
    """What a call needs of the model, given by the engine. forward(batch, banned, count): the batch's sampled
    rows' beam candidates, queued (Runner.beam_candidates: .host() gives values and ids [rows, count]); count 0: the
    forward only (its tokens' KV), returning None;
    copy_kv(copies): (src block, dst block, tokens) KV copies; encode(segments): the encoder over source segments,
    writing their cross-attention K/V into the segments' blocks, and decoder_start the decoder's first token, for
    encoder-decoder models (None for decoder-only ones)."""
    forward: Callable[[ForwardBatch, list[list[int]], int], Candidates | None]
    copy_kv: Callable[[list], None]
    eos_token_ids: tuple[int, ...]
    fill_token: int
    vocab_size: int
    encode: Callable[[list[Segment]], None] | None = None
    decoder_start: int | None = None
    # Backends with a device search step (Runner.device_search): the search from where the prompt pass left it,
    # or None where it must be stepped on the host.
    search_on_device: Callable[[SearchStart], DeviceSearch | None] | None = None
    # Calls whose prompts are all at most this long run them a token a forward (decode steps, which replay graphs
    # where the backend has them: cheaper than one prefill forward's launches for a few tokens); 0: never.
    short_prompt: int = 0
    # A model whose positions skip this id (M2M100): a prompt holding it runs in one forward, as transformers does.
    position_padding_id: int | None = None


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

    def __init__(self, requests: list[BeamRequest], limits: Limits, block_size: int, model: BeamModel):
        self.requests, self.limits, self.block_size, self.model = requests, limits, block_size, model
        self.prompts = [decoder_prompt(r, model) for r in requests]
        self.state_slots: list[int] | None = None
        self._check_limits()

    def run(self, pool: BlockPool, cancelled: Callable[[], bool], state_slots: list[int] | None = None
            ) -> list[BeamResult]:
        """state_slots: for a model with recurrent layers, state_slots_needed() slots reserved for the call."""
        self.state_slots = state_slots
        groups = self._prefill(pool, self._encode(pool))
        if self.model.search_on_device is not None and state_slots is None:
            search, members = search_start(groups, pool, self.block_size, self.model.encode is not None)
            on_device = self.model.search_on_device(search)
            if on_device is not None:
                found = run_device_search(on_device, members, cancelled)
                return [BeamResult(r.request_id, found[r.request_id]) for r in self.requests]
        candidates = [prompt_candidates(group) for group in groups]
        results: dict[int, BeamResult] = {}
        while groups:
            if cancelled():
                raise Cancelled()
            searching, copies = [], []
            for group, (values, ids) in zip(groups, candidates):
                parents, done = group.search.step(values, ids)
                positions, going = (group.search.cur_len - 1).tolist(), []
                for i, member in enumerate(group.members):
                    if done[i]:
                        for blocks in member.beams + ([member.cross_blocks] if member.cross_blocks else []):
                            pool.free(blocks)
                        results[member.request.request_id] = BeamResult(member.request.request_id,
                                                                        group.search.hypotheses(i))
                    else:
                        copies += self._fork(pool, member, parents[i].tolist(), positions[i])
                        going.append(i)
                if going:
                    if len(going) < len(group.members):
                        group.search.keep_rows(going)
                        group.members = [group.members[i] for i in going]
                    searching.append(group)
            groups = searching
            if copies:              # one copy of every step's diverging partial blocks, before the next forward
                self.model.copy_kv(copies)
            if groups:
                candidates = self._decode(groups)
        return [results[r.request_id] for r in self.requests]

    def _check_limits(self) -> None:
        limits, max_source_len = self.limits, self.limits.max_source_len
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
        # Each beam's best `keep` come back from the backend: no more than its vocabulary has.
        most = min(MAX_KEEP, self.model.vocab_size)
        for r in self.requests:
            keep = max(2, 1 + len(self.model.eos_token_ids)) * r.params.num_beams
            if keep > most:
                raise InvalidArgument(f"request_id {r.request_id}: num_beams={r.params.num_beams} with "
                                      f"{len(self.model.eos_token_ids)} EOS ids keeps {keep} continuations a step, "
                                      f"over {most} (at most {MAX_KEEP}, and the vocabulary's size)")
        sources = sum(len(r.src_tokens) for r in self.requests)
        if sources > limits.max_batch_tokens:
            raise BatchTooLarge(sources, limits.max_batch_tokens)
        beams = sum(r.params.num_beams for r in self.requests)
        if beams > min(limits.max_seqs, limits.max_batch_tokens):
            raise BatchTooLarge(beams, min(limits.max_seqs, limits.max_batch_tokens), "max_seqs")

    def blocks_needed(self) -> int:
        return sum(blocks_needed(r, len(p), self.block_size) for r, p in zip(self.requests, self.prompts))

    def state_slots_needed(self) -> int:
        """A model with recurrent layers: two sets of num_beams state slots per request."""
        return sum(2 * r.params.num_beams for r in self.requests)

    def _encode(self, pool: BlockPool) -> list[list[int] | None]:
        """Encoder-decoder models: every source through the encoder at once, its cross-attention K/V into blocks
        of its own; the blocks of each request (None for decoder-only models)."""
        if self.model.encode is None:
            return [None] * len(self.requests)
        cross = [pool.allocate(blocks_for(len(r.src_tokens), self.block_size)) for r in self.requests]
        self.model.encode([Segment(BlockTable(blocks), 0, r.src_tokens, False)
                           for r, blocks in zip(self.requests, cross)])
        return cross

    def _prefill(self, pool: BlockPool, cross: list[list[int] | None]) -> list[_Group]:
        """Every prompt once; each request starts with num_beams beams on the prompt's blocks, its last row's
        candidates (member.prompt) the same for each (transformers runs num_beams copies of the prompt: the same
        rows). Requests are grouped by num_beams, in call order."""
        by_beams: dict[int, list[int]] = {}
        for i, r in enumerate(self.requests):
            by_beams.setdefault(r.params.num_beams, []).append(i)
        m, members = self.model, []
        searches = [(BeamGroup([self.requests[i].params for i in indices], [self.prompts[i] for i in indices],
                               m.eos_token_ids, m.fill_token), indices) for indices in by_beams.values()]
        # Every beam of a request holds the same tokens at the start: its first beam's bans are all of theirs.
        banned = [None] * len(self.requests)
        for search, indices in searches:
            for i, beams in zip(indices, search.banned_tokens()):
                banned[i] = beams[0]
        count = max(search.keep for search, _ in searches)
        pending = []
        by_token = (max(len(p) for p in self.prompts) <= m.short_prompt
                    and all(m.position_padding_id not in p for p in self.prompts))

        def flush():
            forward = self._forward_by_token if by_token else self._forward_whole
            for (*_, member, _), found in zip(pending, forward(pending, count)):
                member.prompt = found
            pending.clear()

        free_slots = iter(self.state_slots or ())
        for r, prompt, cross_blocks, bans in zip(self.requests, self.prompts, cross, banned):
            # Token by token, a forward has a row per request (at most max_seqs, which the call was checked for).
            if (pending and not by_token
                    and sum(len(p) for p, _, _, _ in pending) + len(prompt) > self.limits.max_batch_tokens):
                flush()
            blocks = pool.allocate(blocks_for(len(prompt), self.block_size))
            pool.share(blocks * (r.params.num_beams - 1))
            members.append(_Request(r, [blocks] * r.params.num_beams, cross_blocks, len(r.src_tokens)))
            if self.state_slots is not None:        # the prompt's state into the first set's first slot
                k = r.params.num_beams
                sets = ([next(free_slots) for _ in range(k)], [next(free_slots) for _ in range(k)])
                members[-1].state_sets, members[-1].beam_states = sets, [sets[0][0]] * k
            pending.append((prompt, blocks, members[-1], bans))
        flush()
        return [_Group(search, [members[i] for i in indices]) for search, indices in searches]

    def _forward_whole(self, pending: list, count: int) -> list[tuple[Candidates, int]]:
        """The pending prompts (prompt, blocks, member, bans) in one prefill forward: each one's last row's
        candidates, as (the forward's candidates, row)."""
        segments = [Segment(BlockTable(blocks), 0, prompt, True, member.cross,
                            None if member.beam_states is None else (-1, member.beam_states[0]))
                    for prompt, blocks, member, _ in pending]
        found = self.model.forward(build_batch(segments, self.block_size), [b for *_, b in pending], count)
        return [(found, row) for row in range(len(pending))]

    def _forward_by_token(self, pending: list, count: int) -> list[tuple[Candidates, int]]:
        """The pending prompts a token a forward, as decode steps (a graph replay each, where the backend has
        them): the candidates of each prompt's last token, as (that forward's candidates, row). A prompt ends at
        its own length; the others go on."""
        found: list = [None] * len(pending)
        encoder_decoder = pending[0][2].cross is not None
        for j in range(max(len(prompt) for prompt, *_ in pending)):
            live = [i for i, (prompt, *_) in enumerate(pending) if len(prompt) > j]
            last = [row for row, i in enumerate(live) if len(pending[i][0]) == j + 1]
            covering = blocks_for(j + 1, self.block_size)        # the blocks of positions 0..j, as build_batch's
            states = None
            if self.state_slots is not None:        # each prompt's state, in place, in its first slot
                states = [(-1 if j == 0 else slot, slot) for slot in (pending[i][2].beam_states[0] for i in live)]
            batch = build_decode_batch([pending[i][0][j] for i in live], [j] * len(live),
                                       [pending[i][1][:covering] for i in live], self.block_size,
                                       [pending[i][2].cross for i in live] if encoder_decoder else None, states)
            if not last:        # no prompt ends here: its KV only (the host builds the next batch meanwhile)
                self.model.forward(batch, [], 0)
                continue
            candidates = self.model.forward(batch, [pending[i][3] for i in live], count)
            for row in last:
                found[live[row]] = (candidates, row)
        return found

    def _fork(self, pool: BlockPool, member: _Request, parents: list[int], position: int) -> list:
        """The new running beams' blocks: each continues its parent's, and gets a block of its own where it writes
        its new token (at `position`) into a block another beam also holds, or starts a new one. Returns the KV
        copies that makes (src block, dst block, filled slots): a source stays held by another beam."""
        index, offset = divmod(position, self.block_size)
        children = [list(member.beams[p]) for p in parents]
        # Each beam's blocks gain a holder per child beyond the first, or lose the beam's hold if it has none.
        counts = [0] * len(member.beams)
        for p in parents:
            counts[p] += 1
        for blocks, count in zip(member.beams, counts):
            if count == 0:
                pool.free(blocks)
            elif count > 1:
                pool.share(blocks * (count - 1))
        copies = []
        for blocks in children:
            if offset == 0:
                blocks.extend(pool.allocate(1))
            elif pool.is_shared(blocks[index]):
                own = pool.allocate(1)[0]
                copies.append((blocks[index], own, offset))
                pool.free([blocks[index]])
                blocks[index] = own
        member.beams = children
        if member.beam_states is not None:
            member.sources = [member.beam_states[p] for p in parents]
        return copies

    def _decode(self, groups: list[_Group]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over every running beam; candidates (values, ids) [requests, beams, count] per group."""
        tokens, positions, tables, crosses, banned, states = [], [], [], [], [], []
        for group in groups:
            k = group.search.num_beams
            tokens += group.search.last_tokens().view(-1).tolist()
            for member, position, bans in zip(group.members, (group.search.cur_len - 1).tolist(),
                                              group.search.banned_tokens()):
                positions += [position] * k
                tables += member.beams
                crosses += [member.cross] * k
                banned += bans
                if member.state_sets is not None:   # parents' states in, this step's into the other set
                    written = member.state_sets[member.writes]
                    states += zip(member.sources, written)
                    member.beam_states, member.writes = written, 1 - member.writes
        batch = build_decode_batch(tokens, positions, tables, self.block_size,
                                   crosses if self.model.encode is not None else None,
                                   states if self.state_slots is not None else None)
        values, ids = finite(*self.model.forward(batch, banned, max(group.search.keep for group in groups)).host())
        out, start = [], 0
        for group in groups:
            n, k = len(group.members), group.search.num_beams
            out.append((values[start:start + n * k].view(n, k, -1), ids[start:start + n * k].view(n, k, -1)))
            start += n * k
        return out


def prompt_candidates(group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The host search's first candidates: values, ids [requests, beams, count], each request's prompt row once
    per beam (refused where not finite)."""
    values, ids = finite(*rows_of([m.prompt for m in group.members]))
    return tuple(part[:, None].expand(-1, group.search.num_beams, -1) for part in (values, ids))
