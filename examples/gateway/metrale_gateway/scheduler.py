"""Continuous batching of completions on one stream of one worker: every step carries each running sequence's next
token and, within the worker's max_batch_tokens and max_seqs, the next chunk of a prompt (one MixedForward); a
request is admitted once the blocks its prompt and its token limit need are free; the gateway stops each sequence
(EOS, stop ids, stop strings in the text of its tokens, its token limit) and releases it. Several completions of
one prompt (n > 1) prefill it once: all but its last token as a finished prompt (the token sampled there is
dropped), Fork to the other sequences, then each sequence's first decode feeds the prompt's last token and samples
its own first token."""

import asyncio
import itertools
from dataclasses import dataclass, field

from metrale.v1 import worker_pb2 as pb
from metrale_gateway.link import WorkerLink

DONE = object()         # the end of a completion's token stream


class TooLarge(ValueError):
    """A request that could never be admitted: more blocks or sequences than the worker has at all."""


@dataclass
class Reservations:
    """The KV blocks a worker's requests have reserved: one for all the schedulers of its streams (they share its
    pool). Blocks given back wake every one of them: a stream whose waiting request did not fit may fit now."""
    blocks: int = 0
    waiters: list[asyncio.Event] = field(default_factory=list)

    def give_back(self, blocks: int) -> None:
        self.blocks -= blocks
        for wake in self.waiters:
            wake.set()


@dataclass
class Completion:
    """One request: its prompt and limits, and what the gateway generated for it (without the stop token)."""
    prompt: list[int]
    max_tokens: int
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    output: pb.OutputOptions = field(default_factory=pb.OutputOptions)    # logprobs, top_logprobs
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()      # stop strings: the completion ends where its text first holds one
    ignore_eos: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)                   # with output.logprobs: each token's
    top_logprobs: list[dict[int, float]] = field(default_factory=list)   # with output.top_logprobs
    text: str = ""                  # with stop strings: the text of `tokens` (the worker's Detokenize), cut before
                                    # the stop string that ended it
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
    prompt_end: int = 0     # the prompt tokens this sequence prefills (a group's first: all but the last)
    children: list["_Running"] = field(default_factory=list)    # a group's other sequences, forked from this one
    forked: bool = False    # a group's other sequence: exists once its first has been forked


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Scheduler:
    """run() drives the stream until stop(); generate() from any task on the same loop."""

    def __init__(self, link: WorkerLink, stream: int = 0, chunk_tokens: int = 512, seq_ids=None,
                 reservations: Reservations | None = None):
        self.link, self.stream, self.chunk_tokens = link, stream, chunk_tokens
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count(1)
        self._waiting: list[tuple[list[Completion], bool]] = []     # groups of one prompt, and whether to fork
        self._running: dict[int, _Running] = {}
        self._reserved = reservations if reservations is not None else Reservations()
        self._wake = asyncio.Event()
        self._reserved.waiters.append(self._wake)
        self._stopped = False

    def submit(self, completion: Completion) -> None:
        """Queues the completion (its load counts at once); tokens() then streams it."""
        self.submit_group([completion])

    def submit_group(self, completions: list[Completion], fork: bool = True) -> None:
        """Queues completions of one prompt (n > 1: prefilled once, then forked), admitted together; tokens()
        streams each. Each keeps its own limits and stops; where the prompt is forked all sample with the first's
        parameters, the worker deriving each fork's seed from the first's and its seq_id (one-token prompts are not
        forked: each samples with its own). fork=False: each prefills the prompt itself (the prefix cache still
        shares its full blocks) and samples with its own parameters, e.g. seeds that must not depend on seq ids."""
        if any(c.prompt != completions[0].prompt for c in completions):
            raise ValueError("a group's completions share one prompt")
        self._waiting.append((completions, fork))
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
        """Sequences waiting or running here."""
        return sum(len(group) for group, _ in self._waiting) + len(self._running)

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
        """Waiting requests, in order, while their blocks fit beside the running ones' and max_seqs allows. A group's
        other sequences reserve only what they do not share with its first: the prompt's full blocks before its
        last token are shared after the fork."""
        while self._waiting:
            group, fork = self._waiting[0]
            group = [c for c in group if not c.cancelled]
            if not group:
                self._waiting.pop(0)
                continue
            if len(self._running) + len(group) > info.max_seqs and self._running:
                break
            prompt_len, block_size = len(group[0].prompt), info.kv_block_size
            forks = fork and len(group) > 1 and prompt_len > 1
            shared = (prompt_len - 1) // block_size if forks else 0
            blocks = [blocks_for(prompt_len + c.max_tokens, block_size) - (shared if i else 0)
                      for i, c in enumerate(group)]
            if sum(blocks) > info.num_kv_blocks or len(group) > info.max_seqs:     # never: fail it, go on
                self._waiting.pop(0)
                error = TooLarge(f"{len(group)} sequences of {prompt_len} + up to {group[0].max_tokens} tokens need "
                                 f"{sum(blocks)} KV blocks; the worker has {info.num_kv_blocks} and runs "
                                 f"{info.max_seqs} sequences at most")
                for completion in group:
                    completion.finish_reason = "error"
                    completion._out.put_nowait(error)
                continue
            if self._reserved.blocks + sum(blocks) > info.num_kv_blocks:
                break
            self._waiting.pop(0)
            self._reserved.blocks += sum(blocks)
            runs = [_Running(c, next(self._seq_ids), b, prompt_end=prompt_len) for c, b in zip(group, blocks)]
            if forks:
                runs[0].prompt_end, runs[0].children = prompt_len - 1, runs[1:]
                for child in runs[1:]:
                    child.forked = True
            self._running.update((r.seq_id, r) for r in runs)

    def _next_chunk(self, info: pb.InfoResponse, decode_rows: int) -> tuple[_Running, pb.PrefillSlice] | None:
        """The next slice of the first prompt still being sent, as much as the step has room for."""
        room = min(self.chunk_tokens, info.max_batch_tokens - decode_rows)
        if room <= 0 or decode_rows >= info.max_seqs:
            return None
        for running in self._running.values():
            if running.last_token is None and not running.forked:
                prompt, start = running.completion.prompt[:running.prompt_end], running.prefilled
                tokens = prompt[start:start + room]
                last = start + len(tokens) == len(prompt)
                return running, pb.PrefillSlice(seq_id=running.seq_id, tokens=tokens, chunk_start=start,
                                                is_last_chunk=last, sampling=running.completion.sampling,
                                                output=running.completion.output)
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
        answered = []
        tops = {top.seq_id: dict(zip(top.token_ids, top.logprobs)) for top in answer.top_logprobs}
        logprobs = answer.logprobs or [float("nan")] * len(answer.seq_ids)
        for seq_id, token, logprob in zip(answer.seq_ids, answer.tokens, logprobs):
            running = self._running[seq_id]
            if running.children:            # a group's shared prompt is in: its token is dropped
                await self._fork(running)
                continue
            running.last_token = token
            answered.append((running, token, logprob, tops.get(seq_id)))
        texts = await self._texts(answered)
        finished, failed = [], []
        for running, token, logprob, top in answered:
            completion = running.completion
            reason = self._stop_reason(completion, token)
            if isinstance(texts.get(running.seq_id), BaseException):     # its text is unknown: it fails alone
                failed.append((running, texts[running.seq_id]))
                continue
            if reason != "stop" and running.seq_id in texts:
                text = texts[running.seq_id]
                cut = min((i for i in (text.find(stop) for stop in completion.stop) if i >= 0), default=None)
                completion.text = text if cut is None else text[:cut]
                if cut is not None:
                    reason = "stop"
            if reason != "stop":
                completion.tokens.append(token)
                if completion.output.logprobs:
                    completion.logprobs.append(logprob)
                if completion.output.top_logprobs:
                    completion.top_logprobs.append(top or {})
                completion._out.put_nowait(token)
            if reason:
                finished.append((running, reason))
        for running, reason in finished:
            await self._finish(running, reason)
        for running, error in failed:
            await self._finish(running, None, error)

    async def _texts(self, answered: list[tuple]) -> dict[int, str]:
        """The text each answered sequence with stop strings would have with its new token (one Detokenize each,
        at once), or the error that Detokenize answered."""
        wanted = [(r.seq_id, [*r.completion.tokens, token]) for r, token, *_ in answered if r.completion.stop]
        texts = await asyncio.gather(*(self.link.detokenize(tokens) for _, tokens in wanted), return_exceptions=True)
        return {seq_id: text for (seq_id, _), text in zip(wanted, texts)}

    async def _fork(self, first: _Running) -> None:
        """The group's other sequences as copies of its first; then each decodes the prompt's last token."""
        children = [c for c in first.children if c.seq_id in self._running]     # not cancelled meanwhile
        first.children = []
        try:
            if children:
                await self.link.fork(first.seq_id, [c.seq_id for c in children], self.stream)
        except Exception as error:          # nothing was forked: the group fails
            for running in [first, *children]:
                await self._finish(running, None, error, release=running is first)
            return
        for running in [first, *children]:
            running.forked, running.last_token = False, running.completion.prompt[-1]

    def _stop_reason(self, completion: Completion, token: int) -> str | None:
        if (not completion.ignore_eos and token in self.link.info.eos_token_ids) or token in completion.stop_token_ids:
            return "stop"
        if len(completion.tokens) + 1 >= completion.max_tokens:
            return "length"
        return None

    async def _finish(self, running: _Running, reason: str | None, error: BaseException | None = None,
                      release: bool = True) -> None:
        """Ends the completion's stream (with the error, where it failed) and releases the sequence (release=False:
        it does not exist on the worker; a Release that fails is left to the worker's sequence TTL). A group's first
        sequence finished before its fork takes the others with it. Finishing a sequence twice does nothing."""
        if self._running.pop(running.seq_id, None) is None:
            return
        self._reserved.give_back(running.blocks)
        completion = running.completion
        completion.finish_reason = reason or "error"
        completion._out.put_nowait(error if error is not None else DONE)
        children, running.children = running.children, []
        if release and not running.forked:
            try:
                await self.link.release([running.seq_id])
            except Exception:           # the worker is gone or going: its TTL releases the sequence
                pass
        for child in children:
            await self._finish(child, reason, error, release=False)

    async def _drop_cancelled(self) -> None:
        for running in [r for r in self._running.values() if r.completion.cancelled]:
            await self._finish(running, "cancelled")
