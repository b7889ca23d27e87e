"""An OpenAI-compatible HTTP front on the gateway: /v1/completions, /v1/chat/completions (server-sent events with
stream=true) and /v1/models. FastAPI validates the requests (pydantic) and uvicorn serves them; the model's chat
template renders conversations (chat.py); the workers tokenize and detokenize (Tokenize, Detokenize), so the front
needs no model files."""

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from metrale.v1 import worker_pb2 as pb
from metrale_gateway import chat
from metrale_gateway.link import StepFailed
from metrale_gateway.router import Gateway
from metrale_gateway.scheduler import Completion, TooLarge

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class BadRequest(ValueError):
    """A request the front refuses (HTTP 400, OpenAI's error shape)."""


class Sampling(BaseModel):
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False                # an extension, as vLLM's


class CompletionRequest(Sampling):
    model: str | None = None
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


# A worker's refusal as HTTP: the request's fault (400), too much at once (429), anything else the server's (500).
HTTP_OF_GRPC = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429}


def failure_response(error: Exception) -> JSONResponse:
    """A failed generation's answer: the worker's status where it refused the step, else a server error."""
    code = None
    if isinstance(error, TooLarge):
        return error_response(400, str(error))
    if isinstance(error, StepFailed):
        code = next((c for c in grpc.StatusCode if c.value[0] == error.code), None)
    elif isinstance(error, grpc.aio.AioRpcError):
        code = error.code()
    status = HTTP_OF_GRPC.get(code, 500)
    return error_response(status, str(error) if code is None else f"{code.name}: {error_details(error)}",
                          "invalid_request_error" if status < 500 else "server_error")


def error_details(error: Exception) -> str:
    return error.status.message if isinstance(error, StepFailed) else error.details()


def held_back(text: str, stops: tuple[str, ...]) -> str:
    """The part of a growing text that is safe to send: before a stop string it holds, and without a trailing
    part that could still become one, or an unfinished character."""
    cut = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=None)
    if cut is not None:
        return text[:cut]
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                text = text[:-k]
                break
    return text.rstrip("\ufffd")


class Front:
    """The app's state: the gateway, and what the first worker's Info tells about the model."""

    def __init__(self, gateway: Gateway, model_name: str | None):
        self.gateway, self.model_name = gateway, model_name
        self.info: pb.InfoResponse | None = None
        self.special: dict[str, str] = {}

    @property
    def link(self):
        return self.gateway.links[0]

    async def start(self) -> None:
        await self.gateway.start()
        self.info = self.link.info
        self.model_name = self.model_name or self.info.model_id
        for name, token in (("bos_token", self.info.bos_token_id if self.info.HasField("bos_token_id") else None),
                            ("eos_token", self.info.eos_token_ids[0] if self.info.eos_token_ids else None)):
            self.special[name] = "" if token is None else await self.token_text(token)

    async def token_text(self, token: int) -> str:
        return await self.link.detokenize([token], skip_special_tokens=False)

    async def tokenize(self, text: str, special: bool) -> list[int]:
        return list((await self.link.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=special))).tokens)

    def group(self, prompt: list[int], request: Sampling, max_tokens: int | None,
              output: pb.OutputOptions) -> list[Completion]:
        """The request's n completions of the prompt, checked against the model's length."""
        if not prompt:
            raise BadRequest("the prompt is empty")
        room = self.info.max_model_len - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt's {len(prompt)} tokens leave no room in the model's "
                             f"{self.info.max_model_len}")
        if max_tokens is not None and max_tokens > room:
            raise BadRequest(f"max_tokens {max_tokens} passes the model's length: {len(prompt)} prompt tokens of "
                             f"{self.info.max_model_len}")
        stops = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
        if any(not stop for stop in stops):
            raise BadRequest("a stop string is empty")
        def sampling(i: int) -> pb.SamplingParams:   # a seed: choice i samples with seed + i
            params = pb.SamplingParams(temperature=request.temperature, top_p=request.top_p)
            if request.seed is not None:
                params.seed = request.seed + i
            return params
        return [Completion(prompt=prompt, max_tokens=max_tokens or room, sampling=sampling(i), stop=stops,
                           ignore_eos=request.ignore_eos, output=output) for i in range(request.n)]

    async def run(self, group: list[Completion]):
        """Each completion's events as they come, interleaved: (index, text delta, its new tokens' indices,
        finish reason or None). Cancelling the consumer cancels every completion of the group. Unseeded, the
        group forks one prefill; seeded, each choice samples with its own seed (which a fork would derive from
        seq ids, different each time), its prompt's full blocks shared by the prefix cache instead."""
        seeded = group[0].sampling.HasField("seed")
        scheduler = await self.gateway.route(*group, fork=not seeded)
        events: asyncio.Queue = asyncio.Queue()

        async def follow(index: int, completion: Completion) -> None:
            sent, reported = "", 0
            try:
                async for _ in scheduler.tokens(completion):
                    text = held_back(await self.link.detokenize(completion.tokens), completion.stop)
                    upto = len(completion.tokens)
                    if len(text) > len(sent):
                        await events.put((index, text[len(sent):], range(reported, upto), None))
                        sent, reported = text, upto
                final = completion.text if completion.stop else await self.link.detokenize(completion.tokens)
                await events.put((index, final[len(sent):], range(reported, len(completion.tokens)),
                                  completion.finish_reason))
            except Exception as error:      # the worker failed it
                await events.put(error)

        tasks = [asyncio.create_task(follow(i, c)) for i, c in enumerate(group)]
        try:
            running = len(group)
            while running:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                running -= event[3] is not None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def create_app(addresses: list[str], model_name: str | None = None, chunk_tokens: int = 512) -> FastAPI:
    front = Front(Gateway(addresses, chunk_tokens), model_name)

    @asynccontextmanager
    async def lifespan(app):
        await front.start()
        yield
        await front.gateway.stop()

    app = FastAPI(title="metrale-gateway", lifespan=lifespan)
    app.state.front = front

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return error_response(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()))

    @app.exception_handler(BadRequest)
    async def refused(request: Request, error: BadRequest):
        return error_response(400, str(error))

    @app.exception_handler(grpc.aio.AioRpcError)
    async def worker_refused(request: Request, error: grpc.aio.AioRpcError):     # Tokenize, MatchPrefix, ...
        return failure_response(error)

    @app.exception_handler(chat.TemplateError)
    async def template_refused(request: Request, error: chat.TemplateError):
        return error_response(400, str(error))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": front.model_name, "object": "model", "created": 0,
                                            "owned_by": "metrale"}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        prompt = (await front.tokenize(request.prompt, special=True) if isinstance(request.prompt, str)
                  else list(request.prompt))
        output = pb.OutputOptions(logprobs=request.logprobs is not None, top_logprobs=request.logprobs or 0)
        group = front.group(prompt, request, request.max_tokens or 16, output)
        return await answer(group, "text_completion", request.stream, legacy_logprobs=request.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        if not front.info.chat_template:
            raise BadRequest(f"the model {front.model_name} has no chat template: use /v1/completions")
        text = chat.render(front.info.chat_template, [m.model_dump() for m in request.messages], front.special)
        prompt = await front.tokenize(text, special=False)
        output = pb.OutputOptions(logprobs=request.logprobs, top_logprobs=request.top_logprobs or 0)
        group = front.group(prompt, request, request.max_completion_tokens or request.max_tokens, output)
        return await answer(group, "chat.completion", request.stream, chat_logprobs=request.logprobs)

    async def answer(group: list[Completion], kind: str, stream: bool, legacy_logprobs: bool = False,
                     chat_logprobs: bool = False):
        ident = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": ident, "created": created, "model": front.model_name}

        async def logprobs_of(completion: Completion, indices: range):
            if not (legacy_logprobs or chat_logprobs):
                return None
            tokens = [completion.tokens[i] for i in indices]
            strings = await asyncio.gather(*(front.token_text(t) for t in tokens))
            tops = [completion.top_logprobs[i] if i < len(completion.top_logprobs) else {} for i in indices]
            top_strings = [await asyncio.gather(*(front.token_text(t) for t in top)) for top in tops]
            values = [completion.logprobs[i] for i in indices]
            if chat_logprobs:
                return {"content": [{"token": s, "logprob": v, "bytes": list(s.encode()),
                                     "top_logprobs": [{"token": ts, "logprob": lp, "bytes": list(ts.encode())}
                                                      for ts, lp in zip(names, top.values())]}
                                    for s, v, top, names in zip(strings, values, tops, top_strings)]}
            return {"tokens": strings, "token_logprobs": values,
                    "top_logprobs": [dict(zip(names, top.values())) for top, names in zip(tops, top_strings)]}

        if stream:
            async def events():
                chunk_kind = "chat.completion.chunk" if kind.startswith("chat") else "text_completion"
                try:
                    if kind.startswith("chat"):
                        for i in range(len(group)):
                            yield sse({**head, "object": chunk_kind, "choices": [
                                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
                    async for index, delta, indices, finish in front.run(group):
                        logprobs = await logprobs_of(group[index], indices)
                        choice = ({"index": index, "delta": {"content": delta} if delta else {},
                                   "finish_reason": finish, "logprobs": logprobs} if kind.startswith("chat") else
                                  {"index": index, "text": delta, "finish_reason": finish, "logprobs": logprobs})
                        yield sse({**head, "object": chunk_kind, "choices": [choice]})
                except Exception as error:
                    yield sse({"error": {"message": str(error), "type": "server_error", "code": 500}})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        texts = ["" for _ in group]
        try:
            async for index, delta, _, _ in front.run(group):
                texts[index] += delta
        except Exception as error:
            return failure_response(error)
        choices = []
        for i, (completion, text) in enumerate(zip(group, texts)):
            logprobs = await logprobs_of(completion, range(len(completion.tokens)))
            if kind.startswith("chat"):
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": completion.finish_reason, "logprobs": logprobs})
            else:
                choices.append({"index": i, "text": text, "finish_reason": completion.finish_reason,
                                "logprobs": logprobs})
        generated = sum(len(c.tokens) for c in group)
        usage = {"prompt_tokens": len(group[0].prompt), "completion_tokens": generated,
                 "total_tokens": len(group[0].prompt) + generated}
        return {**head, "object": kind, "choices": choices, "usage": usage}

    return app


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
