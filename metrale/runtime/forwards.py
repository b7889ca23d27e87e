"""The model's forwards through the runner: a batch's forward or encoder pass, replayed as a graph where the runner
has one and the model says the batch allows it, and beam search's forwards, copies and device search. Each runs
under the forward lock where the runner cannot run two forwards at once."""

import contextlib
import threading

from metrale.runtime.backend.runner import Runner
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.beam.call import SHORT_PROMPT, BeamModel
from metrale.runtime.beam.on_device import DeviceSearch, LockedDeviceSearch, SearchStart
from metrale.runtime.cache.manager import CacheManager


class Forwards:
    def __init__(self, model, runner: Runner, cache: CacheManager, kv_block_size: int):
        self.model, self.runner, self.cache, self.kv_block_size = model, runner, cache, kv_block_size
        # Held around each forward (from its launches to its sampling) where the runner cannot run two at once.
        self.lock = contextlib.nullcontext() if runner.concurrent_forwards else threading.Lock()

    def forward(self, batch: ForwardBatch):
        """The model over one flat batch, logits on the device: what the runner calls, or captures."""
        return self.model.forward(batch, self.cache.layers)

    def encode(self, batch: ForwardBatch) -> None:
        """An encoder-decoder's encoder over one batch of sources: what the runner calls, or captures."""
        self.model.encode(batch, self.cache.layers)

    def run(self, batch: ForwardBatch):
        """forward(batch) through the runner; the caller holds the lock."""
        return self.runner.run_forward(self.forward, batch, self.model.replayable(batch))

    def run_encoder(self, batch: ForwardBatch) -> None:
        """encode(batch) through the runner; the caller holds the lock."""
        self.runner.run_encoder(self.encode, batch, self.model.replayable(batch))

    # Beam search's (BeamModel's): each takes the lock itself.

    def beam_encode(self, segments: list[Segment]) -> None:
        with self.lock:
            self.run_encoder(build_batch(segments, self.kv_block_size))

    def beam_forward(self, batch: ForwardBatch, banned: list[list[int]], count: int):
        """The batch's sampled rows' beam candidates (Runner.beam_candidates), queued; count 0: the forward alone
        (queued, not waited for), None."""
        with self.lock:
            logits = self.run(batch)
            return self.runner.beam_candidates(logits, banned, count) if count else None

    def device_search(self, start: SearchStart) -> DeviceSearch | None:
        with self.lock:
            found = self.runner.device_search(start, self.forward, self.cache.layers)
        return None if found is None else LockedDeviceSearch(found, self.lock)

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        self.runner.copy_block_prefixes(self.cache.layers, copies)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_state_slots(self.cache.layers, copies)

    def beam_model(self, num_requests: int, eos_token_ids: tuple[int, ...], fill_token: int) -> BeamModel:
        """What a BeamCall of num_requests requests runs the model through."""
        config = self.model.config
        encoder_decoder = getattr(config, "is_encoder_decoder", False)
        return BeamModel(self.beam_forward, self.copy_blocks, eos_token_ids, fill_token, config.vocab_size,
                         self.beam_encode if encoder_decoder else None,
                         config.decoder_start_token_id if encoder_decoder else None, self.device_search,
                         self._short_prompt(num_requests, encoder_decoder),
                         getattr(self.model, "position_padding_id", None))

    def _short_prompt(self, num_requests: int, encoder_decoder: bool) -> int:
        """BeamModel.short_prompt: prompts of a few tokens run a token a forward where decode steps replay graphs,
        unless the whole prompts' one forward replays a graph too (an encoder-decoder's, where the runner has
        prefill graphs): one launch either way, and one forward instead of a few."""
        if encoder_decoder and self.runner.prefill_graphs:
            return 0
        return SHORT_PROMPT if num_requests <= self.runner.decode_graph_rows else 0
