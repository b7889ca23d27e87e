"""The Worker servicer: one method per RPC; each converts, submits to a device lane, and converts back."""

import asyncio
import contextlib
import threading

import structlog

from metrale.runtime.beam.params import check_requests
from metrale.runtime.build import VERSION, ModelInfo
from metrale.runtime.engine import Engine
from metrale.runtime.errors import Draining, FailedPrecondition, InvalidArgument, UnknownSequence
from metrale.runtime.lanes import DeviceLanes
from metrale.runtime.run_ahead import LanePacer
from metrale.runtime.step import Step, check_token_ids
from metrale.service import convert
from metrale.service.generate import generate_tokens
from metrale.service.metrics import WorkerMetrics
from metrale.v1 import worker_pb2 as pb
from metrale.v1 import worker_pb2_grpc

# Generate's own sequences take ids from here up; gateways use ids below.
RESERVED_SEQ_IDS = 1 << 63


class ServingState:
    """Draining flag and in-flight count, shared by the servicer and the shutdown path."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @contextlib.contextmanager
    def admitted(self):
        """Counts a forward RPC as in flight; refuses it once the worker drains."""
        if self.draining:
            raise Draining()
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, lanes: DeviceLanes, info: ModelInfo, tokenizer, state: ServingState,
                 metrics: WorkerMetrics):
        self.metrics = metrics
        self.engine = engine
        self.lanes = lanes
        self.info = info
        self.tokenizer = tokenizer
        self.state = state
        self._next_generate_id = RESERVED_SEQ_IDS
        # Per stream: the order of a decode answer and the lane's guessed next step (run_ahead.py).
        self.pacers = [LanePacer() for _ in range(lanes.num_lanes)]

    async def Info(self, request, context):
        i, c, stats = self.info, self.engine.config, self.engine.stats()
        return pb.InfoResponse(
            model_id=i.model_id, architecture=i.architecture, dtype=i.dtype, device=i.device,
            vocab_size=i.vocab_size, max_model_len=i.max_model_len, kv_block_size=c.kv_block_size,
            num_kv_blocks=stats.num_kv_blocks, free_kv_blocks=stats.free_kv_blocks,
            is_mla=False, hc_mult=1, supports_beam=self.engine.supports_beam,
            is_encoder_decoder=self.engine.is_encoder_decoder, has_ssm=False,
            eos_token_ids=list(i.eos_token_ids), bos_token_id=i.bos_token_id, pad_token_id=i.pad_token_id,
            num_streams=self.lanes.num_lanes, max_batch_tokens=c.max_batch_tokens, version=VERSION,
            live_sequences=stats.live_sequences)

    async def Prefill(self, request, context):
        return await self._forward(convert.step_from_prefill(request), request.stream)

    async def Decode(self, request, context):
        return await self._forward(convert.step_from_decode(request), request.stream)

    async def MixedForward(self, request, context):
        return await self._forward(convert.step_from_mixed(request), request.stream)

    async def BeamGenerate(self, request, context):
        if not self.engine.supports_beam:
            raise FailedPrecondition(f"beam search is not available for {self.info.architecture} on the "
                                     f"{self.info.device} backend yet (Info.supports_beam=false)")
        requests = convert.beam_requests_from_pb(request)
        structlog.contextvars.bind_contextvars(request_ids=[r.request_id for r in requests], stream=request.stream)
        check_requests(requests, self.info.vocab_size, self.engine.is_encoder_decoder)
        eos, fill = self.info.eos_token_ids, self.info.pad_token_id or 0
        with self.state.admitted():
            results, _ = await self.run_on_lane(
                request.stream, [], lambda cancelled: self.engine.beam_generate(requests, eos, fill, cancelled))
        return convert.beam_response(results)

    async def Release(self, request, context):
        if request.all:
            ids = [i for i in self.engine.live_seq_ids() if i < RESERVED_SEQ_IDS]
        else:
            ids = list(dict.fromkeys(request.seq_ids))
        structlog.contextvars.bind_contextvars(seq_ids=ids)
        # Generate's sequences are its own: to a gateway they do not exist.
        reserved = [i for i in ids if i >= RESERVED_SEQ_IDS]
        ids = [i for i in ids if i < RESERVED_SEQ_IDS]
        result, _ = await self.run_on_lane(0, ids, lambda cancelled: self.engine.release(ids))
        return pb.ReleaseResponse(released_seq_ids=result.released, unknown_seq_ids=result.unknown + reserved,
                                  blocks_freed=result.blocks_freed)

    async def PrefillTailSplit(self, request, context):
        if not request.tokens:
            raise InvalidArgument("tokens is empty")
        check_token_ids("PrefillTailSplit", request.tokens, self.info.vocab_size)
        # Attention-only models keep no SSM state, so any chunk end is fine: no split.
        return pb.PrefillTailSplitResponse()

    async def NormalizeSsmStates(self, request, context):
        live = set(self.engine.live_seq_ids())
        unknown = [i for i in request.seq_ids if i not in live or i >= RESERVED_SEQ_IDS]
        if unknown:
            raise UnknownSequence(unknown)
        return pb.NormalizeSsmStatesResponse()

    async def Tokenize(self, request, context):
        tokens = self._tokenizer().encode(request.text, add_special_tokens=request.add_special_tokens)
        return pb.TokenizeResponse(tokens=tokens)

    async def Detokenize(self, request, context):
        check_token_ids("Detokenize", request.tokens, self.info.vocab_size)
        text = self._tokenizer().decode(list(request.tokens), skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def Generate(self, request, context):
        self.lanes.check_lane(request.stream)
        seq_id = self._next_generate_id
        self._next_generate_id += 1
        with self.state.admitted():
            async for response in generate_tokens(request, seq_id, self):
                yield response

    def _tokenizer(self):
        if self.tokenizer is None:
            raise FailedPrecondition(f"this model has no tokenizer ({self.info.tokenizer_note}); send token ids")
        return self.tokenizer

    async def _forward(self, step: Step, stream: int) -> pb.ForwardResponse:
        ids = step.seq_ids
        structlog.contextvars.bind_contextvars(seq_ids=ids, stream=stream)
        reserved = [i for i in ids if i >= RESERVED_SEQ_IDS]
        if reserved:
            raise InvalidArgument(f"seq_id(s) {reserved} are >= 2^63, a range the worker keeps for Generate")
        step.check(self.info.vocab_size)
        with self.state.admitted():
            out, queue_us = await self.run_step(stream, step)
        return convert.forward_response(out, queue_us)

    async def run_step(self, stream: int, step: Step):
        """Runs one engine step on the stream's lane; returns (StepOutput, queue_us)."""
        self.lanes.check_lane(stream)
        pacer = self.pacers[stream]
        pacer.request_arrived()
        result = await self.run_on_lane(stream, step.seq_ids,
                                        lambda cancelled: self.engine.step(step, cancelled, run_ahead=True),
                                        after=pacer)
        self.metrics.count_step(step)
        return result

    def release_in_order(self, stream: int, seq_ids: list[int]) -> None:
        """Frees sequences after the work already queued on the stream; not awaited, so it survives cancellation."""
        self.lanes.submit_in_order(stream, lambda: self.engine.release(seq_ids))

    async def run_on_lane(self, stream: int, seq_ids: list[int], work, after=None):
        """Runs work(cancelled) on the stream's device lane; returns (result, queue_us). If this handler is
        cancelled (client cancel, deadline), cancelled() turns true, and the engine undoes the step at its next
        round boundary."""
        cancel = threading.Event()
        future = self.lanes.submit(stream, seq_ids, lambda: work(cancel.is_set), after)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()
            raise
