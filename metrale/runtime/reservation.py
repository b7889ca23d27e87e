"""What a step holds of the cache, and how it is given back: a step's reservation (its new sequences, the blocks
its sequences grow by, a state slot for each where the model keeps a recurrent state) is taken all or nothing;
an undone step restores its sequences from the snapshot taken with it, a done step commits (gives the state slots
it replaced back). Callers hold the engine's state lock."""

from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.planner import Plan
from metrale.runtime.sampling import random_seed
from metrale.runtime.sequence import BlockTable, Sequence, SequenceTable

# seq_id -> (num_tokens, num_blocks, prompt_finished, num_prompt_tokens, state_slot) of a sequence the step touches
# that existed before it.
Snapshot = dict[int, tuple[int, int, bool, int, int]]


class Reservations:
    def __init__(self, sequences: SequenceTable, cache: CacheManager):
        self.sequences, self.cache = sequences, cache

    def reserve(self, plan: Plan) -> Snapshot:
        """Creates the plan's new sequences and takes every block and state slot it needs; returns what restore (or,
        once the step is done, commit) needs. All or nothing: what an error midway had done is undone."""
        snapshot = {i: (seq.num_tokens, len(seq.block_table), seq.prompt_finished, seq.num_prompt_tokens,
                        seq.state_slot) for i in plan.final_lengths if (seq := self.sequences.get(i)) is not None}
        try:
            self._take(plan)
        except BaseException:
            self.restore(snapshot, plan)
            raise
        return snapshot

    def _take(self, plan: Plan) -> None:
        """One reservation for the new sequences' cross blocks (their sources'), the blocks the sequences grow by,
        and a new state slot per sequence where the model keeps a recurrent state (the one before stays, as the
        step's snapshot)."""
        for s in plan.new_sequences:
            seed = s.sampling.seed if s.sampling.seed is not None else random_seed()
            self.sequences.add(Sequence(s.seq_id, s.sampling, s.output, seed))
        size = self.cache.block_size
        sources = {seq_id: blocks_for(length, size) for seq_id, length in plan.sources.items()}
        grown = {seq_id: max(0, blocks_for(length, size) - len(self.sequences.get(seq_id).block_table))
                 for seq_id, length in plan.final_lengths.items()}
        stateful = list(plan.final_lengths) if self.cache.has_state else []
        blocks, slots = self.cache.reserve(sum(sources.values()) + sum(grown.values()), len(stateful))
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

    def commit(self, snapshot: Snapshot) -> None:
        """The step is done: the state slots its sequences had before it (their snapshots) are given back."""
        if not self.cache.has_state:
            return
        for seq_id, (*_, state_slot) in snapshot.items():
            seq = self.sequences.get(seq_id)
            if state_slot >= 0 and (seq is None or seq.state_slot != state_slot):
                self.cache.free([], [state_slot])

    def free(self, seq: Sequence) -> int:
        """Gives a removed sequence's blocks back (its cross blocks too) and its state slots; returns how many
        blocks."""
        blocks = seq.block_table.tolist() + (seq.cross_table.tolist() if seq.cross_table is not None else [])
        self.cache.free(blocks, {slot for slot in (seq.state_slot, seq.state_source) if slot >= 0})
        return len(blocks)
