"""Continuous batching of completions on one stream of one worker: every step carries each running sequence's next
token and, within the worker's max_batch_tokens and max_seqs, the next chunk of a prompt (one MixedForward); a
request is admitted once the blocks its prompt and its token limit need are free; the gateway stops each sequence
(EOS, stop ids, its token limit) and releases it."""

import asyncio
import itertools
from dataclasses import dataclass, field

from metrale.v1 import worker_pb2 as pb
from metrale_gateway.link import WorkerLink

DONE = object()         # the end of a completion's token stream


@dataclass
class Completion:
    """One request: its prompt and limits, and what the gateway generated for it (without the stop token)."""
    prompt: list[int]
    max_tokens: int
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None            # "stop" or "length"
    cancelled: bool = False
    _out: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)


@dataclass
class _Running:
    completion: Completion
    seq_id: int
    blocks: int             # reserved for the whole request: prompt and token limit
    prefilled: int = 0      # prompt tokens sent so far
    last_token: int | None = None   # the token the next decode sends back (None: the prompt is not finished)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Scheduler:
    """run() drives the stream until stop(); generate() from any task on the same loop."""

    def __init__(self, link: WorkerLink, stream: int = 0, chunk_tokens: int = 512, seq_ids=None):
        self.link, self.stream, self.chunk_tokens = link, stream, chunk_tokens
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count(1)
        self._waiting: list[Completion] = []
        self._running: dict[int, _Running] = {}
        self._reserved = 0
        self._wake = asyncio.Event()
        self._stopped = False

    def submit(self, completion: Completion) -> None:
        """Queues the completion (its load counts at once); tokens() then streams it."""
        self._waiting.append(completion)
        self._wake.set()

    async def generate(self, completion: Completion):
        """submit(), then tokens()."""
        self.submit(completion)
        async for token in self.tokens(completion):
            yield token

    async def tokens(self, completion: Completion):
        """A submitted completion's tokens as they come; cancelling the consumer cancels the request (its sequence
        is released at the next step boundary)."""
        try:
            while (token := await completion._out.get()) is not DONE:
                if isinstance(token, BaseException):
                    raise token
                yield token
        finally:
            if completion.finish_reason is None:
                completion.cancelled = True
                self._wake.set()

    @property
    def load(self) -> int:
        """Requests waiting or running here."""
        return len(self._waiting) + len(self._running)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        info = self.link.info
        while not self._stopped:
            await self._drop_cancelled()
            self._admit(info)
            decode = [r for r in self._running.values() if r.last_token is not None]
            prefill = self._next_chunk(info, len(decode))
            if not decode and prefill is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step(decode, prefill)

    def _admit(self, info: pb.InfoResponse) -> None:
        """Waiting requests, in order, while their blocks fit beside the running ones' and max_seqs allows."""
        while self._waiting and len(self._running) < info.max_seqs:
            completion = self._waiting[0]
            if completion.cancelled:
                self._waiting.pop(0)
                continue
            blocks = blocks_for(len(completion.prompt) + completion.max_tokens, info.kv_block_size)
            if self._reserved + blocks > info.num_kv_blocks:
                break
            self._waiting.pop(0)
            self._reserved += blocks
            seq_id = next(self._seq_ids)
            self._running[seq_id] = _Running(completion, seq_id, blocks)

    def _next_chunk(self, info: pb.InfoResponse, decode_rows: int) -> tuple[_Running, pb.PrefillSlice] | None:
        """The next slice of the first prompt still being sent, as much as the step has room for."""
        room = min(self.chunk_tokens, info.max_batch_tokens - decode_rows)
        if room <= 0 or decode_rows >= info.max_seqs:
            return None
        for running in self._running.values():
            if running.last_token is None:
                prompt, start = running.completion.prompt, running.prefilled
                tokens = prompt[start:start + room]
                last = start + len(tokens) == len(prompt)
                return running, pb.PrefillSlice(seq_id=running.seq_id, tokens=tokens, chunk_start=start,
                                                is_last_chunk=last, sampling=running.completion.sampling)
        return None

    async def _step(self, decode: list[_Running], prefill: tuple[_Running, pb.PrefillSlice] | None) -> None:
        decode_request = pb.DecodeRequest(seq_ids=[r.seq_id for r in decode], tokens=[r.last_token for r in decode],
                                          stream=self.stream)
        prefill_request = pb.PrefillRequest(slices=[prefill[1]], stream=self.stream) if prefill else None
        try:
            if decode and prefill:
                answer = await self.link.step(mixed=pb.MixedForwardRequest(decode=decode_request,
                                                                           prefill=prefill_request,
                                                                           stream=self.stream))
            elif decode:
                answer = await self.link.step(decode=decode_request)
            else:
                answer = await self.link.step(prefill=prefill_request)
        except Exception as error:        # the step changed nothing: its requests fail, the rest go on
            for running in decode + ([prefill[0]] if prefill else []):
                await self._finish(running, None, error)
            return
        if prefill:
            running, piece = prefill
            running.prefilled += len(piece.tokens)
        finished = []
        for seq_id, token in zip(answer.seq_ids, answer.tokens):
            running = self._running[seq_id]
            running.last_token = token
            reason = self._stop_reason(running.completion, token)
            if reason != "stop":
                running.completion.tokens.append(token)
                running.completion._out.put_nowait(token)
            if reason:
                finished.append((running, reason))
        for running, reason in finished:
            await self._finish(running, reason)

    def _stop_reason(self, completion: Completion, token: int) -> str | None:
        if (not completion.ignore_eos and token in self.link.info.eos_token_ids) or token in completion.stop_token_ids:
            return "stop"
        if len(completion.tokens) + 1 >= completion.max_tokens:
            return "length"
        return None

    async def _finish(self, running: _Running, reason: str | None, error: BaseException | None = None) -> None:
        """Releases the sequence and ends the completion's stream (with the error, where it failed)."""
        del self._running[running.seq_id]
        self._reserved -= running.blocks
        completion = running.completion
        completion.finish_reason = reason or "error"
        await self.link.release([running.seq_id])
        completion._out.put_nowait(error if error is not None else DONE)

    async def _drop_cancelled(self) -> None:
        for running in [r for r in self._running.values() if r.completion.cancelled]:
            await self._finish(running, "cancelled")
