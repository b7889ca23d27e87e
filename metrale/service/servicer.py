"""The Worker servicer: one method per RPC; each converts, checks, submits to a stream, and converts back.

Nothing slow runs on the event loop: a request carrying many ids is converted and checked on a thread, text work
runs on its own threads (text.py), and steps on the streams."""

import asyncio
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from metrale.runtime.beam.params import check_requests
from metrale.runtime.build import VERSION, ModelInfo
from metrale.runtime.engine import Engine
from metrale.runtime.errors import (NAMED_IDS, FailedPrecondition, InvalidArgument, OutOfRange,
                                    ReplyTooLarge, UnknownSequence, name_ids)
from metrale.runtime.streams import StreamThreads
from metrale.runtime.run_ahead import StreamPacer
from metrale.runtime.step import Step, StepOutput, check_token_ids
from metrale.service import convert
from metrale.service.convert import INLINE_IDS
from metrale.service.admission import ServingState
from metrale.service.config import WorkerConfig
from metrale.service.generate import generate_tokens
from metrale.service.metrics import WorkerMetrics
from metrale.service.steps import StepChannel
from metrale.service.text import TextWork
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc

log = structlog.get_logger()

# Generate's own sequences take ids from here up; gateways use ids below.
RESERVED_SEQ_IDS = 1 << 63
# The most bytes ForwardResponse.queue_us adds once the answer is built (tag and a 10-byte varint).
QUEUE_US_BYTES = 11


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, threads: StreamThreads, info: ModelInfo, tokenizer, state: ServingState,
                 metrics: WorkerMetrics, config: WorkerConfig, on_fault=lambda: None):
        self.metrics = metrics
        self.on_fault = on_fault        # a device fault's report (health NOT_SERVING), for errors the channel answers
        self.engine = engine
        self.threads = threads
        self.info = info
        self.tokenizer = tokenizer
        self.text = TextWork(tokenizer, config.max_text_bytes, info.vocab_size, info.max_model_len,
                             info.tokenizer_note)
        self.state = state
        self.max_message_bytes = config.max_message_bytes
        self.sequence_ttl = config.sequence_ttl
        # Release's work, which needs no device: never queued behind a stream's steps.
        self._control = ThreadPoolExecutor(1, thread_name_prefix="control")
        self._next_generate_id = RESERVED_SEQ_IDS
        # Per stream: the order of a decode answer and the stream's guessed next step (run_ahead.py).
        self.pacers = [StreamPacer() for _ in range(threads.num_streams)]

    async def Info(self, request, context):
        i, c, stats = self.info, self.engine.config, self.engine.stats()
        return pb.InfoResponse(
            model_id=i.model_id, architecture=i.architecture, dtype=i.dtype, device=i.device,
            vocab_size=i.vocab_size, max_model_len=i.max_model_len, kv_block_size=c.kv_block_size,
            num_kv_blocks=stats.num_kv_blocks, free_kv_blocks=stats.free_kv_blocks,
            is_mla=i.is_mla, hc_mult=i.hc_mult, supports_beam=self.engine.supports_beam,
            is_encoder_decoder=self.engine.is_encoder_decoder, has_ssm=i.has_ssm,
            eos_token_ids=list(i.eos_token_ids), bos_token_id=i.bos_token_id, pad_token_id=i.pad_token_id,
            num_streams=self.threads.num_streams, max_batch_tokens=c.max_batch_tokens, version=VERSION,
            live_sequences=stats.live_sequences, prefix_cache=i.prefix_cache, cached_kv_blocks=stats.cached_kv_blocks,
            max_seqs=c.max_seqs, sequence_ttl_seconds=self.sequence_ttl, chat_template=i.chat_template,
            kv_dtype=i.kv_dtype)

    async def Prefill(self, request, context):
        return await self._forward(request, convert.step_from_prefill, request.stream)

    async def Decode(self, request, context):
        return await self._forward(request, convert.step_from_decode, request.stream)

    async def MixedForward(self, request, context):
        return await self._forward(request, convert.step_from_mixed, request.stream)

    async def BeamGenerate(self, request, context):
        if not self.engine.supports_beam:
            raise FailedPrecondition(f"beam search is not available for {self.info.architecture} on the "
                                     f"{self.info.device} backend yet (Info.supports_beam=false)")
        self.threads.check_stream(request.stream)
        structlog.contextvars.bind_contextvars(request_ids=[r.request_id for r in request.requests[:NAMED_IDS]],
                                               num_requests=len(request.requests), stream=request.stream)

        def checked():
            requests = convert.beam_requests_from_pb(request)
            check_requests(requests, self.info.vocab_size, self.info.max_model_len, self.engine.is_encoder_decoder)
            return requests

        requests = await self._off_loop_if_large(convert.beam_id_count(request), checked)
        eos, fill = self.info.eos_token_ids, self.info.pad_token_id or 0
        with self.state.admitted():
            results, _ = await self.run_on_stream(
                request.stream, [], lambda cancelled: self.engine.beam_generate(requests, eos, fill, cancelled))
        return convert.beam_response(results)

    async def Release(self, request, context):
        structlog.contextvars.bind_contextvars(seq_ids=list(request.seq_ids[:NAMED_IDS]),
                                               num_seqs=len(request.seq_ids), all=request.all)

        def split() -> tuple[list[int], list[int]]:
            """The gateway's ids, once each; and Generate's, which to a gateway do not exist."""
            if request.all:
                return [i for i in self.engine.live_seq_ids() if i < RESERVED_SEQ_IDS], []
            ids = list(dict.fromkeys(request.seq_ids))
            return [i for i in ids if i < RESERVED_SEQ_IDS], [i for i in ids if i >= RESERVED_SEQ_IDS]

        ids, reserved = await self._off_loop_if_large(len(request.seq_ids), split)
        # Off the streams: a Release must not wait behind steps on other sequences (capacity is freed under load).
        result = await asyncio.wrap_future(self.threads.run_claimed(self._control, ids, lambda: self.engine.release(ids)))
        return pb.ReleaseResponse(released_seq_ids=result.released, unknown_seq_ids=result.unknown + reserved,
                                  blocks_freed=result.blocks_freed)

    async def expire_idle(self) -> int:
        """Releases the gateway's sequences no step or Fork has touched for --sequence-ttl seconds (Generate's own
        end with their call); returns how many."""
        ttl = self.sequence_ttl
        ids = [i for i in self.engine.idle_seq_ids(ttl) if i < RESERVED_SEQ_IDS]
        if not ids:
            return 0
        result = await asyncio.wrap_future(
            self.threads.run_claimed(self._control, ids, lambda: self.engine.release_idle(ids, ttl)))
        if result.released:
            self.metrics.expired.inc(len(result.released))
            log.info("sequences_expired", seq_ids=result.released[:NAMED_IDS], count=len(result.released),
                     blocks_freed=result.blocks_freed, ttl=ttl)
        return len(result.released)

    async def PrefillTailSplit(self, request, context):
        if not request.tokens:
            raise InvalidArgument("tokens is empty")
        if len(request.tokens) > self.info.max_model_len:
            raise OutOfRange(f"{len(request.tokens)} tokens pass max_model_len={self.info.max_model_len}")
        check_token_ids("PrefillTailSplit", request.tokens, self.info.vocab_size)
        return pb.PrefillTailSplitResponse(split=self.engine.prefill_tail_split(len(request.tokens)))

    async def NormalizeSsmStates(self, request, context):
        ids = list(dict.fromkeys(request.seq_ids))

        def check() -> None:
            live = set(self.engine.live_seq_ids())
            unknown = [i for i in ids if i not in live or i >= RESERVED_SEQ_IDS]
            if unknown:
                raise UnknownSequence(unknown)

        await self._off_loop_if_large(len(ids), check)
        # Off the streams, as Release: a guess on these sequences is settled, nothing waits behind other steps.
        await asyncio.wrap_future(self.threads.run_claimed(self._control, ids, lambda: self.engine.normalize_states(ids)))
        return pb.NormalizeSsmStatesResponse()

    async def MatchPrefix(self, request, context):
        def matched() -> int:
            if len(request.tokens) > self.info.max_model_len:
                raise OutOfRange(f"{len(request.tokens)} tokens pass max_model_len={self.info.max_model_len}")
            check_token_ids("MatchPrefix", request.tokens, self.info.vocab_size)
            return self.engine.match_prefix(list(request.tokens), request.cache_salt)

        return pb.MatchPrefixResponse(cached_tokens=await self._off_loop_if_large(len(request.tokens), matched))

    async def Fork(self, request, context):
        self.threads.check_stream(request.stream)
        children = list(request.child_seq_ids)
        reserved = [i for i in [request.parent_seq_id, *children] if i >= RESERVED_SEQ_IDS]
        if reserved:
            raise InvalidArgument(f"seq_id(s) {name_ids(reserved)} are >= 2^63, a range the worker keeps for "
                                  f"Generate")
        if len(children) > self.engine.config.max_seqs:
            raise InvalidArgument(f"{len(children)} children: at most max_seqs={self.engine.config.max_seqs} a call")
        structlog.contextvars.bind_contextvars(seq_ids=[request.parent_seq_id, *children[:NAMED_IDS]],
                                               stream=request.stream)
        ids = list(dict.fromkeys([request.parent_seq_id, *children]))
        with self.state.admitted():
            result, _ = await self.run_on_stream(
                request.stream, ids, lambda cancelled: self.engine.fork(request.parent_seq_id, children))
        return pb.ForkResponse(child_seq_ids=result.child_seq_ids, blocks_shared=result.blocks_shared)

    async def Tokenize(self, request, context):
        tokens = await self.text.encode(request.text, request.add_special_tokens)
        return pb.TokenizeResponse(tokens=tokens)

    async def Detokenize(self, request, context):
        text = await self.text.decode(request.tokens, request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def Generate(self, request, context):
        self.threads.check_stream(request.stream)
        seq_id = self._next_generate_id
        self._next_generate_id += 1
        with self.state.admitted():
            async for response in generate_tokens(request, seq_id, self):
                yield response

    async def Steps(self, request_iterator, context):
        await StepChannel(self, context).serve(request_iterator)

    async def _forward(self, request, to_step, stream: int, envelope=None, admit: bool = True):
        """Runs the request as one step; its answer: a ForwardResponse, or envelope (a StepResponse) with the
        answer as its result, built on the stream's thread. admit=False: the caller admitted it (a Steps channel,
        at the step's arrival)."""
        self.threads.check_stream(stream)

        def checked() -> Step:
            step = to_step(request)
            if step.seq_ids and max(step.seq_ids) >= RESERVED_SEQ_IDS:
                reserved = [i for i in step.seq_ids if i >= RESERVED_SEQ_IDS]
                raise InvalidArgument(f"seq_id(s) {name_ids(reserved)} are >= 2^63, a range the worker keeps for "
                                      f"Generate")
            step.check(self.info.vocab_size, self.info.max_model_len)
            self._check_reply_fits(step)
            return step

        step = await self._off_loop_if_large(convert.step_id_count(request), checked)
        ids = step.seq_ids
        structlog.contextvars.bind_contextvars(seq_ids=ids[:NAMED_IDS], num_seqs=len(ids), stream=stream)
        with self.state.admitted() if admit else contextlib.nullcontext():
            out, queue_us = await self.run_step(stream, step, lambda out: self._reply(out, envelope))
        (out.reply if envelope is None else out.reply.result).queue_us = queue_us
        return out.reply

    def _check_reply_fits(self, step: Step) -> None:
        """Refuses a step whose logits rows alone would not fit in one message, before it runs."""
        row_bytes = 4 * self.info.vocab_size
        if (len(step.decode) + len(step.prefill)) * row_bytes <= self.max_message_bytes:
            return      # not even every output carrying logits would pass the limit
        logits_bytes = self.engine.rows_returning_logits(step) * row_bytes
        if logits_bytes > self.max_message_bytes:
            raise ReplyTooLarge(logits_bytes, self.max_message_bytes, exact=False)

    def _reply(self, out: StepOutput, envelope=None):
        """The step's answer, built on the stream's thread before the step counts as done: one that could not be sent
        (over the message limit) undoes the step."""
        response = pb.ForwardResponse() if envelope is None else envelope
        convert.forward_response(out, response if envelope is None else envelope.result)
        size = response.ByteSize() + QUEUE_US_BYTES
        if size > self.max_message_bytes:
            raise ReplyTooLarge(size, self.max_message_bytes)
        return response

    async def _off_loop_if_large(self, num_ids: int, work):
        """work(), on a thread where the request is large enough to hold the event loop up."""
        if num_ids <= INLINE_IDS:
            return work()
        return await asyncio.to_thread(work)

    async def run_step(self, stream: int, step: Step, reply=None):
        """Runs one engine step on the stream's thread; returns (StepOutput, queue_us). reply: Engine.step's."""
        self.threads.check_stream(stream)
        pacer = self.pacers[stream]
        pacer.request_arrived()
        result = await self.run_on_stream(stream, step.seq_ids,
                                        lambda cancelled: self.engine.step(step, cancelled, run_ahead=True,
                                                                           reply=reply),
                                        after=pacer)
        self.metrics.count_step(step)
        return result

    def close(self) -> None:
        self.text.close()
        self._control.shutdown(wait=True)

    def release_in_order(self, stream: int, seq_ids: list[int]) -> Future:
        """Frees sequences after the work already queued on the stream; the caller may wait for it, or not (it then
        survives the caller's cancellation)."""
        return self.threads.submit_in_order(stream, lambda: self.engine.release(seq_ids))

    async def run_on_stream(self, stream: int, seq_ids: list[int], work, after=None):
        """Runs work(cancelled) on the stream's stream; returns (result, queue_us). If this handler is
        cancelled (client cancel, deadline), cancelled() turns true, and the engine undoes the step at its next
        round boundary."""
        cancel = Flag()
        submitted = self.threads.submit(stream, seq_ids, lambda: work(cancel.is_set), after)
        try:
            return await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:
            # Cancelling the wait cancelled the work too where the stream had not started it; work under way stops at
            # its next round boundary, and the call stays admitted (--max-concurrent-rpcs) until it has.
            cancel.set()
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(submitted)
            raise


class Flag:
    """A flag one thread sets and another reads (a bool's store and load are atomic under the GIL): the cancel of
    one step, without the lock and condition of a threading.Event."""

    __slots__ = ("_set",)

    def __init__(self):
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set
