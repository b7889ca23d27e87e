"""What a step holds of the cache, and how it is given back: a step's reservation (its new sequences, the blocks
its sequences grow by, a state slot for each where the model keeps a recurrent state) is taken all or nothing;
an undone step restores its sequences from the snapshot taken with it, a done step commits (gives the state slots
it replaced back). With the prefix cache, a model with recurrent layers also keeps the state after each prefill
chunk that ends on a block boundary (cache/states.py), and a new sequence resumes from the deepest one its prompt
matches. Callers hold the engine's state lock."""

from dataclasses import dataclass, replace

from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.cache.prefix import Match, block_names, chain_root, match_prompt
from metrale.runtime.planner import Plan
from metrale.runtime.sampling import random_seed
from metrale.runtime.sequence import BlockTable, Sequence, SequenceTable
from metrale.runtime.step import Step

@dataclass
class ReleaseResult:
    released: list[int]
    unknown: list[int]
    blocks_freed: int


# seq_id -> (num_tokens, num_blocks, prompt_finished, num_prompt_tokens, state_slot) of a sequence the step touches
# that existed before it.
Snapshot = dict[int, tuple[int, int, bool, int, int]]


class Reservations:
    def __init__(self, sequences: SequenceTable, cache: CacheManager, namespace: str = ""):
        """namespace: what the prefix cache's chains start from beside a prompt's salt (the model)."""
        self.sequences, self.cache, self.namespace = sequences, cache, namespace

    def match_prompts(self, step: Step) -> dict[int, Match]:
        """What the prefix cache holds of each new sequence's prompt (every new sequence gets its chain's root)."""
        if not self.cache.prefix_cache:
            return {}
        return {s.seq_id: self.match(s.tokens, s.cache_salt) for s in step.prefill if s.chunk_start == 0}

    def match(self, tokens, cache_salt: str) -> Match:
        """What the prefix cache holds of a prompt with this salt, that a new sequence can resume from (with
        recurrent layers: up to the deepest block that has a state snapshot); changes nothing."""
        root = chain_root(self.namespace, cache_salt)
        match = match_prompt(self.cache.blocks, root, tokens, self.cache.block_size)
        if not self.cache.has_state or not match.blocks:
            return match
        states = self.cache.states
        keep = next((n for n in range(len(match.names), 0, -1) if states.snapshot(match.names[n - 1]) is not None), 0)
        return replace(match, blocks=match.blocks[:keep], names=match.names[:keep],
                       tokens=keep * self.cache.block_size)

    def reserve(self, plan: Plan, matches: dict[int, Match] | None = None, evict_snapshots: bool = True) -> Snapshot:
        """Creates the plan's new sequences (matches: what the prefix cache holds of their prompts, attached to
        them) and takes every block and state slot it needs; returns what restore (or, once the step is done,
        commit) needs. All or nothing: what an error midway had done is undone. evict_snapshots False: state slots
        only from the free ones (a guess's)."""
        snapshot = {i: (seq.num_tokens, len(seq.block_table), seq.prompt_finished, seq.num_prompt_tokens,
                        seq.state_slot) for i in plan.final_lengths if (seq := self.sequences.get(i)) is not None}
        try:
            self._take(plan, matches or {}, evict_snapshots)
        except BaseException:
            self.restore(snapshot, plan)
            raise
        return snapshot

    def _take(self, plan: Plan, matches: dict[int, Match], evict_snapshots: bool = True) -> None:
        """One reservation for the new sequences' cross blocks (their sources'), the blocks the sequences grow by,
        and a new state slot per sequence where the model keeps a recurrent state (the one before stays, as the
        step's snapshot); first, the cached blocks a new sequence's prompt starts with, by reference."""
        for s in plan.new_sequences:
            seed = s.sampling.seed if s.sampling.seed is not None else random_seed()
            seq = Sequence(s.seq_id, s.sampling, s.output, seed)
            self.sequences.add(seq)
            if (match := matches.get(s.seq_id)) is not None:
                self._attach(seq, match, s.tokens)
                if match.blocks and self.cache.has_state:     # its state: the snapshot after the last block
                    slot = self.cache.states.snapshot(match.names[-1])
                    self.cache.states.pin(slot)
                    seq.state_source = plan.resumes[s.seq_id] = slot
        size = self.cache.block_size
        sources = {seq_id: blocks_for(length, size) for seq_id, length in plan.sources.items()}
        grown = {seq_id: max(0, blocks_for(length, size) - len(self.sequences.get(seq_id).block_table))
                 for seq_id, length in plan.final_lengths.items()}
        stateful = list(plan.final_lengths) if self.cache.has_state else []
        blocks, slots = self.cache.reserve(sum(sources.values()) + sum(grown.values()), len(stateful),
                                           evict_snapshots)
        taken = 0
        for seq_id, count in sources.items():
            seq = self.sequences.get(seq_id)
            seq.cross_table, seq.source_len = BlockTable(blocks[taken:taken + count]), plan.sources[seq_id]
            taken += count
        for seq_id, count in grown.items():
            self.sequences.get(seq_id).block_table.extend(blocks[taken:taken + count])
            taken += count
        for seq_id, slot in zip(stateful, slots):
            self.sequences.get(seq_id).state_slot = slot
        if self.cache.has_state and self.cache.prefix_cache:
            self._take_snapshot_slots(plan)

    def _take_snapshot_slots(self, plan: Plan) -> None:
        """A slot for the state after each prefill chunk that ends on a block boundary, where one is free: a
        snapshot is worth keeping, not worth failing a step for."""
        size, states = self.cache.block_size, self.cache.states
        for chunks in plan.rounds:
            for c in chunks:
                prefill = not c.samples or c.ends_prompt        # not a decode token
                if prefill and (c.start + len(c.tokens)) % size == 0:
                    c.snapshot_slot = states.take_snapshot_slot()

    def _attach(self, seq: Sequence, match: Match, prompt) -> None:
        """The sequence starts as if it had computed the match's tokens itself."""
        self.cache.blocks.attach(match)
        seq.block_table.extend(match.blocks)
        seq.tokens.extend(prompt[:match.tokens])
        seq.cache_root, seq.block_names, seq.cached_tokens = match.root, list(match.names), match.tokens

    def restore(self, snapshot: Snapshot, plan: Plan) -> None:
        """Puts the plan's sequences back as the snapshot has them; those it created (where they got that far) are
        removed."""
        for seq_id in plan.final_lengths:
            if seq_id not in snapshot:
                if (created := self.sequences.remove(seq_id)) is not None:
                    self.free(created)
                continue
            seq = self.sequences.get(seq_id)
            num_tokens, num_blocks, finished, num_prompt, state_slot = snapshot[seq_id]
            del seq.tokens[num_tokens:]
            replaced = [seq.state_slot] if seq.state_slot != state_slot else []
            self.cache.free(seq.block_table.truncate(num_blocks), replaced)
            seq.prompt_finished, seq.num_prompt_tokens = finished, num_prompt
            seq.state_slot = seq.state_source = state_slot
        self._settle_snapshots(plan, keep=False)

    def commit(self, snapshot: Snapshot, plan: Plan) -> None:
        """The step is done: the state slots its sequences had before it (their snapshots) are given back, and the
        blocks it filled join the prefix cache (no undo can take their tokens back now)."""
        if self.cache.prefix_cache:
            size = self.cache.block_size
            for seq_id, length in plan.final_lengths.items():
                # only a sequence that filled a block (one decode step in kv_block_size) has one to name
                before = snapshot[seq_id][0] if seq_id in snapshot else 0
                if length // size > before // size and (seq := self.sequences.get(seq_id)) is not None:
                    self._register(seq, length)
        if not self.cache.has_state:
            return
        self._settle_snapshots(plan, keep=True)
        for seq_id, (*_, state_slot) in snapshot.items():
            seq = self.sequences.get(seq_id)
            if state_slot >= 0 and (seq is None or seq.state_slot != state_slot):
                self.cache.free([], [state_slot])

    def _settle_snapshots(self, plan: Plan, keep: bool) -> None:
        """The step's snapshot slots kept under their blocks' names (keep: the step is done and its blocks named)
        or given back, and the snapshots its new sequences resumed from unpinned."""
        states, size = self.cache.states, self.cache.block_size
        for chunks in plan.rounds:
            for c in chunks:
                if c.snapshot_slot < 0:
                    continue
                seq, block = self.sequences.get(c.seq_id), (c.start + len(c.tokens)) // size - 1
                if keep and seq is not None and block < len(seq.block_names):
                    states.keep_snapshot(seq.block_names[block], c.snapshot_slot)
                else:
                    states.drop_snapshot_slot(c.snapshot_slot)
                c.snapshot_slot = -1
        for slot in plan.resumes.values():
            states.unpin(slot)
        plan.resumes.clear()

    def _register(self, seq: Sequence, length: int) -> None:
        """Names the full blocks of the sequence's first `length` tokens (the committed step's; a guess queued
        after it may hold one more, which fills a block of its own where blocks are one token) it has not named
        yet, and registers them."""
        size, named = self.cache.block_size, len(seq.block_names)
        if not seq.cache_root or length // size <= named:
            return
        tokens = seq.tokens if len(seq.tokens) == length else seq.tokens[:length]
        names = block_names(seq.block_names[-1] if named else seq.cache_root, tokens, size, named)
        table = seq.block_table.array()
        for i, name in enumerate(names, named):
            self.cache.blocks.register(int(table[i]), name)
        seq.block_names.extend(names)

    def release(self, seq_ids: list[int]) -> ReleaseResult:
        """Removes the sequences and frees what they hold; ids not live are reported."""
        released, unknown, freed = [], [], 0
        for seq_id in seq_ids:
            seq = self.sequences.remove(seq_id)
            if seq is None:
                unknown.append(seq_id)
                continue
            freed += self.free(seq)
            released.append(seq_id)
        return ReleaseResult(released, unknown, freed)

    def free(self, seq: Sequence) -> int:
        """Gives a removed sequence's blocks back (its cross blocks too) and its state slots; returns how many
        blocks."""
        blocks = seq.block_table.tolist() + (seq.cross_table.tolist() if seq.cross_table is not None else [])
        self.cache.free(blocks, {slot for slot in (seq.state_slot, seq.state_source) if slot >= 0})
        return len(blocks)
