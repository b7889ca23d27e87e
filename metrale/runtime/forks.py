"""Fork: children that continue a parent sequence from where it is, sharing its full blocks by reference; the
partly filled last block is copied for each child, since a child writes into it, and so is the parent's recurrent
state (a model with recurrent layers), into a state slot of each child's own. Callers hold the engine's state lock;
the copies are the caller's to run on the device."""

import hashlib
from dataclasses import dataclass, replace

from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.errors import FailedPrecondition, InvalidArgument, UnknownSequence
from metrale.runtime.sequence import BlockTable, Sequence, SequenceTable


@dataclass(frozen=True)
class ForkResult:
    child_seq_ids: list[int]
    # The parent's blocks each child holds by reference.
    blocks_shared: int


def child_seed(parent_seed: int, child_seq_id: int) -> int:
    """A child's sampling seed: its own (children of one parent sample apart), and the same for the same fork."""
    digest = hashlib.blake2b(parent_seed.to_bytes(8, "little") + child_seq_id.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def check_fork(sequences: SequenceTable, cache: CacheManager, parent_id: int, child_ids: list[int]) -> Sequence:
    """The parent, once the fork is known to be possible: raises before anything changes."""
    parent = sequences.get(parent_id)
    if parent is None:
        raise UnknownSequence([parent_id])
    if not child_ids:
        raise InvalidArgument("child_seq_ids is empty: name the children to create")
    if len(set(child_ids)) != len(child_ids) or parent_id in child_ids:
        raise InvalidArgument("child_seq_ids must be distinct, and not the parent's")
    live = [i for i in child_ids if i in sequences]
    if live:
        raise InvalidArgument(f"seq_id(s) {live[:8]} are live: a child must be a new sequence")
    if not parent.prompt_finished:
        raise FailedPrecondition(f"seq_id {parent_id}: its prompt is not finished; fork it once it is")
    return parent


def fork(sequences: SequenceTable, cache: CacheManager, parent: Sequence, child_ids: list[int]
         ) -> tuple[ForkResult, list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Creates the children: each shares the parent's full blocks (and cross blocks), and gets a block of its own
    for the parent's partly filled last one and a state slot where the model keeps a recurrent state, all taken at
    once (OutOfKvBlocks or OutOfStateSlots with nothing taken). Returns the result, the block copies (src, dst,
    tokens) and the state copies (src slot, dst slot) the device must make before a child runs."""
    size = cache.block_size
    full, partial = divmod(parent.num_tokens, size)
    table = parent.block_table.tolist()
    own, slots = cache.reserve(len(child_ids) if partial else 0, len(child_ids) if cache.has_state else 0)
    copies, state_copies = [], [(parent.state_slot, slot) for slot in slots]
    for i, child_id in enumerate(child_ids):
        blocks = table[:full]
        cache.blocks.share(blocks)
        if partial:
            blocks = blocks + [own[i]]
            copies.append((table[full], own[i], partial))
        child = replace(parent, seq_id=child_id, seed=child_seed(parent.seed, child_id), tokens=list(parent.tokens),
                        block_table=BlockTable(blocks), block_names=list(parent.block_names), cached_tokens=0)
        if slots:
            child.state_slot = child.state_source = slots[i]
        if parent.cross_table is not None:
            cache.blocks.share(parent.cross_table.tolist())
            child.cross_table = BlockTable(parent.cross_table.tolist())
        sequences.add(child)
    return ForkResult(list(child_ids), full), copies, state_copies
