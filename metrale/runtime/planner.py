"""Turns a checked Step into forward rounds, after checking it against the sequences' state.

Nothing here changes state: a step that fails planning leaves every sequence and block as it was.
"""

from dataclasses import dataclass, field

from metrale.runtime.errors import BatchTooLarge, FailedPrecondition, InvalidArgument, OutOfKvBlocks, OutOfRange, \
    UnknownSequence
from metrale.runtime.cache.blocks import blocks_for, tail_split
from metrale.runtime.sequence import SequenceTable
from metrale.runtime.step import PrefillSlice, Step


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_batch_tokens: int
    kv_block_size: int
    max_seqs: int
    # Encoder-decoder models: a prefill slice is the source, run by the encoder, and the decoder starts from this
    # token; sources are at most max_source_len tokens.
    decoder_start: int | None = None
    max_source_len: int = 0
    # Models with recurrent layers: a slice the worker splits by its chunk_size also ends a chunk at the prompt's
    # tail split (cache/blocks.tail_split), where the state's snapshot lands; with snapshots (the prefix cache on),
    # every last slice does.
    splits_at_tail: bool = False
    snapshots: bool = False


@dataclass(slots=True)
class Chunk:
    """Tokens one sequence appends in one forward, starting at position `start`."""
    seq_id: int
    tokens: tuple[int, ...]
    start: int
    # Its last token's logits are sampled: a decode token, or the end of a prompt.
    samples: bool
    ends_prompt: bool = False
    # Encoder-decoder models: the source the encoder runs before this (first) chunk.
    source: tuple[int, ...] = ()
    # Models with recurrent layers and snapshots: the state slot the sequence's state after this chunk is copied
    # into (a prefill chunk ending on a block boundary), -1 for none; the reservation takes it.
    snapshot_slot: int = -1


@dataclass(frozen=True)
class Plan:
    # Forwards run in order; decode tokens all run in the first, before any prefill chunk.
    rounds: tuple[tuple[Chunk, ...], ...]
    # Slices with chunk_start=0: their sequences are created before the first round.
    new_sequences: tuple[PrefillSlice, ...]
    # seq_id -> tokens it will hold after the step, for block reservation.
    final_lengths: dict
    # Encoder-decoder models: seq_id -> the length of a new sequence's source, whose cross blocks it takes.
    sources: dict = field(default_factory=dict)
    # Models with recurrent layers: seq_id -> the snapshot slot a new sequence resumes from (pinned until the step
    # is done or undone); filled by the reservation.
    resumes: dict = field(default_factory=dict)


def plan_step(step: Step, sequences: SequenceTable, num_free_blocks: int, limits: Limits,
              cached: dict[int, tuple[int, int]] | None = None) -> Plan:
    """cached: seq_id -> (prompt tokens a new sequence's blocks found in the prefix cache hold, of those blocks the
    ones only the cache holds, which taking draws from the free blocks)."""
    cached = cached or {}
    held = _check_decode(step, sequences, limits)
    _check_prefill(step, sequences, limits)
    rounds: list[list[Chunk]] = [[]]
    final_lengths, sources = {}, {}
    needed = 0
    for entry, seq in zip(step.decode, held):
        start = len(seq.tokens)
        rounds[0].append(Chunk(entry.seq_id, (entry.token,), start, samples=True))
        final_lengths[entry.seq_id] = start + 1
        needed += blocks_for(start + 1, limits.kv_block_size) - len(seq.block_table)
    for s in step.prefill:
        if limits.decoder_start is not None:
            rounds[0].append(Chunk(s.seq_id, (limits.decoder_start,), 0, samples=True, ends_prompt=True,
                                   source=s.tokens))
            final_lengths[s.seq_id] = 1
            sources[s.seq_id] = len(s.tokens)
            needed += blocks_for(len(s.tokens), limits.kv_block_size)
            continue
        cuts = _cuts(s, cached.get(s.seq_id, (0, 0))[0], limits)
        for r, (a, b) in enumerate(zip(cuts, cuts[1:])):
            last = b == len(s.tokens)
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(Chunk(s.seq_id, s.tokens[a:b], s.chunk_start + a,
                                   samples=last and s.is_last_chunk, ends_prompt=last and s.is_last_chunk))
        final_lengths[s.seq_id] = s.chunk_start + len(s.tokens)
    biggest = max(sum(len(c.tokens) + len(c.source) for c in chunks) for chunks in rounds)
    if biggest > limits.max_batch_tokens:
        raise BatchTooLarge(biggest, limits.max_batch_tokens)
    most_sequences = max(len(chunks) for chunks in rounds)
    if most_sequences > limits.max_seqs:
        raise BatchTooLarge(most_sequences, limits.max_seqs, "max_seqs")
    needed += sum(blocks_for(final_lengths[s.seq_id], limits.kv_block_size) - _blocks_held(sequences, s.seq_id)
                  for s in step.prefill)
    needed += sum(only_cached - found // limits.kv_block_size for found, only_cached in cached.values())
    if needed > num_free_blocks:
        raise OutOfKvBlocks(needed, num_free_blocks)
    return Plan(tuple(tuple(r) for r in rounds), tuple(s for s in step.prefill if s.chunk_start == 0), final_lengths,
                sources)


def _cuts(s: PrefillSlice, found: int, limits: Limits) -> list[int]:
    """Where the slice's forwards start and end, as offsets into its tokens: from `found` (tokens the prefix cache
    computed already) to its end, in pieces of its chunk_size (if any), one also ending at the tail split."""
    end = len(s.tokens)
    cuts = list(range(found, end, s.chunk_size or end)) + [end]
    if (s.chunk_size or limits.snapshots) and limits.splits_at_tail and s.is_last_chunk:
        split = tail_split(s.chunk_start + end, limits.kv_block_size)
        if split is not None and found < split - s.chunk_start < end:
            cuts = sorted(set(cuts) | {split - s.chunk_start})
    return cuts


def rows_returning_logits(step: Step, sequences: SequenceTable) -> int:
    """How many of the step's outputs will carry a logits row (OutputOptions.return_logits), known before it
    runs: for the answer's size."""
    rows = sum(1 for entry in step.decode if (seq := sequences.get(entry.seq_id)) is not None
               and seq.output.return_logits)
    for s in step.prefill:
        options = s.output if not s.chunk_start else getattr(sequences.get(s.seq_id), "output", None)
        rows += bool(s.is_last_chunk and options is not None and options.return_logits)
    return rows


def _blocks_held(sequences: SequenceTable, seq_id: int) -> int:
    seq = sequences.get(seq_id)
    return len(seq.block_table) if seq else 0


def _check_decode(step: Step, sequences: SequenceTable, limits: Limits) -> list:
    """The decode tokens' sequences, in order, once each is known to be able to take one more token."""
    held = [sequences.get(entry.seq_id) for entry in step.decode]
    if any(seq is None for seq in held):
        raise UnknownSequence([entry.seq_id for entry, seq in zip(step.decode, held) if seq is None])
    for entry, seq in zip(step.decode, held):
        if not seq.prompt_finished:
            raise FailedPrecondition(f"seq_id {entry.seq_id}: its prompt is not finished "
                                     f"(no slice with is_last_chunk=true yet); it cannot decode")
        if seq.num_tokens + 1 > limits.max_model_len:
            raise OutOfRange(f"seq_id {entry.seq_id}: holds {seq.num_tokens} tokens; one more passes "
                             f"max_model_len={limits.max_model_len}")
    return held


def _check_prefill(step: Step, sequences: SequenceTable, limits: Limits) -> None:
    if limits.decoder_start is not None:
        _check_sources(step, limits)
    unknown = [s.seq_id for s in step.prefill if s.chunk_start > 0 and s.seq_id not in sequences]
    if unknown:
        raise UnknownSequence(unknown)
    for s in step.prefill:
        seq = sequences.get(s.seq_id)
        if s.chunk_start == 0 and seq is not None:
            raise InvalidArgument(f"seq_id {s.seq_id} is live: chunk_start=0 would create it again; "
                                  f"release it first or continue at chunk_start={seq.num_tokens}")
        if seq is not None and seq.prompt_finished:
            raise FailedPrecondition(f"seq_id {s.seq_id}: its prompt is finished; append tokens with Decode")
        if seq is not None and s.chunk_start != seq.num_tokens:
            raise InvalidArgument(f"seq_id {s.seq_id}: chunk_start={s.chunk_start} but the sequence holds "
                                  f"{seq.num_tokens} tokens; the next chunk must start there")
        if limits.decoder_start is None and s.chunk_start + len(s.tokens) > limits.max_model_len:
            raise OutOfRange(f"seq_id {s.seq_id}: {s.chunk_start + len(s.tokens)} tokens pass "
                             f"max_model_len={limits.max_model_len}")


def _check_sources(step: Step, limits: Limits) -> None:
    """An encoder-decoder's prefill slice is its whole source, in one slice: the encoder needs all of it."""
    for s in step.prefill:
        if s.chunk_start != 0 or not s.is_last_chunk or 0 < s.chunk_size < len(s.tokens):
            raise FailedPrecondition(f"seq_id {s.seq_id}: this encoder-decoder model takes its source in one slice "
                                     f"(chunk_start=0, is_last_chunk=true, no chunk_size below its length)")
        if len(s.tokens) > limits.max_source_len:
            raise OutOfRange(f"seq_id {s.seq_id}: a source of {len(s.tokens)} tokens passes the "
                             f"{limits.max_source_len} the encoder takes (its positions, and max_model_len)")
