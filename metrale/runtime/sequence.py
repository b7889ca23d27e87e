"""Per-sequence state the worker keeps between steps, and the table of live sequences."""

from dataclasses import dataclass, field

from metrale.runtime.sampling import OutputOptions, SamplingParams


@dataclass
class Sequence:
    seq_id: int
    sampling: SamplingParams
    output: OutputOptions
    # Resolved sampling seed (uint64): the Philox key.
    seed: int
    # Every token whose KV is cached: the prompt so far, then each decoded token.
    tokens: list[int] = field(default_factory=list)
    prompt_finished: bool = False
    num_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


class SequenceTable:
    def __init__(self):
        self._sequences: dict[int, Sequence] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def get(self, seq_id: int) -> Sequence | None:
        return self._sequences.get(seq_id)

    def add(self, sequence: Sequence) -> None:
        self._sequences[sequence.seq_id] = sequence

    def remove(self, seq_id: int) -> Sequence | None:
        return self._sequences.pop(seq_id, None)

    def ids(self) -> list[int]:
        return list(self._sequences)
