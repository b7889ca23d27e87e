"""A step's rounds: each one forward over its chunks, then the sampling of the rows that sample. A round is launched
(its forward and sampling queued; its sequences hold its tokens from then on) and then finished (its sampling waited
for); its inputs may be staged before (a run-ahead guess's successor, built while its predecessor runs)."""

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from metrale.runtime.backend.runner import QueuedSample, Runner
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.cache.manager import CacheManager
from metrale.runtime.errors import Cancelled
from metrale.runtime.forwards import Forwards
from metrale.runtime.planner import Chunk, Limits
from metrale.runtime.sampling import SampleResult, SampleRow
from metrale.runtime.sequence import Sequence, SequenceTable
from metrale.runtime.step import SequenceOutput


class Rounds:
    """Runs rounds over the engine's sequences, cache and forwards; lock: the engine's state lock, held while a
    launched round's sequences take its tokens."""

    def __init__(self, sequences: SequenceTable, cache: CacheManager, forwards: Forwards, runner: Runner,
                 limits: Limits, kv_block_size: int, encoder_decoder: bool, lock: threading.Lock):
        self.sequences, self.cache, self.forwards, self.runner = sequences, cache, forwards, runner
        self.limits, self.kv_block_size, self.encoder_decoder, self._lock = limits, kv_block_size, encoder_decoder, lock

    def _encode(self, chunks: tuple[Chunk, ...], sequences: list[Sequence]) -> None:
        """Runs the encoder over the round's new sources, writing their cross-attention K/V into their blocks."""
        segments = [Segment(seq.cross_table, 0, c.source, False) for c, seq in zip(chunks, sequences) if c.source]
        if segments:
            self.forwards.run_encoder(build_batch(segments, self.kv_block_size))

    def run(self, chunks: tuple[Chunk, ...], cancelled: Callable[[], bool]) -> list[SequenceOutput]:
        """launch, then finish."""
        return self.finish(self.launch(chunks, cancelled))

    def stage(self, chunks: tuple[Chunk, ...]) -> "Staged":
        """The round's sequences and batch, built as it is launched or before (a guess's successor: while its
        predecessor runs, its tokens to be set at launch)."""
        sequences = [self.sequences.get(c.seq_id) for c in chunks]
        stateful = self.cache.has_state
        segments = [Segment(seq.block_table, c.start, c.tokens, c.samples,
                            (seq.cross_table, seq.source_len) if seq.cross_table is not None else None,
                            (seq.state_source, seq.state_slot) if stateful else None)
                    for c, seq in zip(chunks, sequences)]
        return Staged(sequences, build_batch(segments, self.kv_block_size))

    def launch(self, chunks: tuple[Chunk, ...], cancelled: Callable[[], bool], staged: "Staged | None" = None,
               tokens: list[int] | None = None) -> "Launched":
        """Queues the round's forward and sampling; its sequences hold its tokens from here on. staged: its
        inputs built already (stage), each chunk one token, whose `tokens` (one a chunk, in order) are set here;
        the chunks take them once the forward is queued."""
        fill = staged is not None
        if staged is None:
            staged = self.stage(chunks)
        else:
            staged.batch.token_ids.copy_(torch.tensor(tokens, dtype=torch.int64))
        sequences, batch = staged.sequences, staged.batch
        with self.forwards.lock:
            if self.encoder_decoder:
                self._encode(chunks, sequences)
            # The logits live in the backend's memory until sampled: the lock covers both.
            logits = self.forwards.run(batch)
            if self.limits.snapshots:   # the states after chunks that end on a block boundary, for the prefix cache
                self._copy_snapshots(chunks, sequences)
            if cancelled():
                raise Cancelled()
            with self._lock:
                if fill:
                    for c, token in zip(chunks, tokens):
                        c.tokens = (token,)
                for c, seq in zip(chunks, sequences):
                    seq.tokens.extend(c.tokens)
                    seq.state_source = seq.state_slot
                    if not seq.prompt_finished:
                        seq.num_prompt_tokens = seq.num_tokens
                        seq.prompt_finished = c.ends_prompt
            sampled = [seq for c, seq in zip(chunks, sequences) if c.samples]
            if not sampled:
                return Launched([], [], None)
            cached = [seq.cached_tokens if c.ends_prompt else 0 for c, seq in zip(chunks, sequences) if c.samples]
            # The token lists go by reference; the generated tokens are sliced out only where penalties read them.
            rows = staged.rows or [SampleRow(s.sampling, s.output, s.seed, s.num_tokens, s.tokens,
                                             s.output_tokens if s.sampling.has_penalties else ()) for s in sampled]
            return Launched(sampled, cached, self.runner.queue_sample(logits, rows))

    def _copy_snapshots(self, chunks: tuple[Chunk, ...], sequences: list[Sequence]) -> None:
        copies = [(seq.state_slot, c.snapshot_slot) for c, seq in zip(chunks, sequences) if c.snapshot_slot >= 0]
        if copies:
            self.forwards.copy_states(copies)

    @staticmethod
    def result(launched: "Launched") -> SampleResult:
        """Waits for a launched round's sampling; its result (empty where it samples none)."""
        if launched.sampling is None:
            return SampleResult([], [], [], [])
        return launched.sampling.result()

    @staticmethod
    def finish(launched: "Launched") -> list[SequenceOutput]:
        """Waits for a launched round's sampling; its outputs."""
        return outputs_of(launched, Rounds.result(launched))


def outputs_of(launched: "Launched", result: SampleResult) -> list[SequenceOutput]:
    """A launched round's outputs, from its sampling's result."""
    return list(map(SequenceOutput._make, zip([seq.seq_id for seq in launched.sampled], result.tokens,
                                              result.logprobs, result.top_logprobs, result.logits, launched.cached)))


@dataclass(slots=True)
class Staged:
    """A round's host inputs: its sequences, its batch, and its sampling rows where they were made before its
    launch (None: made at launch)."""
    sequences: list[Sequence]
    batch: ForwardBatch
    rows: list[SampleRow] | None = None


@dataclass(slots=True)
class Launched:
    """A round whose device work is queued: the sequences it samples, the prompt tokens the prefix cache served
    each (where the round finishes the prompt), and the queued sampling (None where it samples none)."""
    sampled: list[Sequence]
    cached: list[int]
    sampling: QueuedSample | None
