"""The OpenAI-compatible HTTP API over one loaded bundle (FastAPI; server-sent events by sse-starlette).

    POST /v1/chat/completions, POST /v1/completions   (stream, stop, max_tokens, temperature, top_p, seed, usage)
    GET  /v1/models, GET /health, GET /metrics (Prometheus)

Each request is tokenized here, priced and admitted by the ``Scheduler``, then decoded by the ``Engine`` thread
together with every other running session. A client that disconnects cancels its session: the engine drops it at
its next turn and its cache state is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse

from edgec.errors import EdgecError, GenerationError, one_line
from edgec.runtime.model import Model
from edgec.serve.engine import Engine, Session
from edgec.serve.engine import Request as GenerationRequest
from edgec.serve.memory import ServerMemory
from edgec.serve.metrics import Metrics
from edgec.serve.scheduler import Busy, Scheduler, Ticket, TooLarge


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields edgec does not use (user, logprobs=false, ...) are accepted

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=0)


class CompletionBody(_Body):
    prompt: str | list[int]


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


class Server:
    """The pieces one app runs on: the model, its scheduler, engine and metrics."""

    def __init__(
        self,
        model: Model,
        name: str,
        memory: ServerMemory,
        max_sessions: int,
        queue_size: int,
        capacities: list,
        max_prompt_tokens: int,
    ) -> None:
        self.model, self.name, self.memory, self.max_prompt_tokens = model, name, memory, max_prompt_tokens
        budget = memory.session_budget if memory.session_budget is not None else float("inf")
        self.scheduler = Scheduler(budget, max_sessions, queue_size, capacities, model.session_bytes)
        self.engine = Engine()
        self.metrics = Metrics(self.scheduler, memory)
        self.created = int(time.time())

    # --- requests → sessions --------------------------------------------------------------------------------
    def tokens(self, body: ChatBody | CompletionBody) -> list[int]:
        if body.model != self.name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {self.name!r}")
        try:
            if isinstance(body, ChatBody):
                messages = [_plain_message(m) for m in body.messages]
                ids = self.model.tokenizer.encode_chat(messages)
            elif isinstance(body.prompt, str):
                ids = self.model.encode(body.prompt)
            else:
                ids = self.model._check_ids(body.prompt)
        except (GenerationError, TypeError) as error:
            raise ApiError(400, one_line(error)) from None
        if not ids:
            raise ApiError(400, "the prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            served = (
                ""
                if self.max_prompt_tokens == self.model.context - 1
                else f"this server takes {self.max_prompt_tokens}; "
            )
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens but {served}this model's context is {self.model.context} tokens "
                "(prompt and answer together); shorten the prompt",
            )
        return ids

    def request(self, body: ChatBody | CompletionBody, ids: list[int]) -> GenerationRequest:
        limit = body.max_completion_tokens if isinstance(body, ChatBody) else None
        limit = limit if limit is not None else body.max_tokens
        room = self.model.context - len(ids)
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if not all(stops):
            raise ApiError(400, "stop strings must not be empty")
        request = GenerationRequest(ids, min(room, limit) if limit is not None else room, body.temperature)
        request.top_p, request.seed, request.stop = body.top_p, body.seed, stops
        try:  # the runtime's own checks, before any memory is taken (the generator starts nothing yet)
            self.model.generate_ids(
                ids,
                max_new_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
            ).close()
        except (GenerationError, TypeError) as error:
            raise ApiError(400, one_line(error)) from None
        return request

    async def start(self, request: GenerationRequest) -> Session:
        arrived = time.perf_counter()
        try:
            ticket = await self.scheduler.admit(len(request.ids))
        except Busy as busy:
            self.metrics.finished("rejected")
            raise ApiError(429, str(busy), {"Retry-After": str(busy.retry_after)}) from None
        except TooLarge as error:
            raise ApiError(400, str(error)) from None
        loop = asyncio.get_running_loop()

        def ended(session: Session) -> None:  # on the engine thread, after the state is freed
            loop.call_soon_threadsafe(self._ended, session, ticket, arrived)

        def prompt_read(session: Session) -> None:  # on the engine thread: the temporary prompt state is gone
            steady = self.model.session_bytes(ticket.capacity)
            loop.call_soon_threadsafe(self.scheduler.settle, ticket, steady)

        try:
            session = Session(self.model, request, ticket.capacity, loop, ended, prompt_read)
        except EdgecError as error:
            self.scheduler.release(ticket, 0.0)
            raise ApiError(400, one_line(error)) from None
        self.metrics.admitted(ticket)
        self.engine.add(session)
        return session

    def _ended(self, session: Session, ticket: Ticket, arrived: float) -> None:
        self.scheduler.release(ticket, time.perf_counter() - arrived)
        self.metrics.ended(session, arrived)


def _plain_message(message: dict[str, Any]) -> dict[str, str]:
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: text parts only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise GenerationError("only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    return {"role": message.get("role"), "content": content}


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.engine.stop()

    app = FastAPI(title="edgec serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error(error.status, error.message, error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request body")

    @app.get("/health")
    async def health() -> dict:
        scheduler = server.scheduler
        return {
            "status": "ok",
            "model": server.name,
            "active_sessions": scheduler.active,
            "queued": scheduler.queued,
            "kv_bytes_in_use": scheduler.in_use,
            "memory": server.memory.to_json(),
            "capacities": scheduler.capacities,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": server.name, "object": "model", "created": server.created, "owned_by": "edgec"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Any:
        return await _complete(server, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        return await _complete(server, body, request, chat=False)

    return app


async def _complete(server: Server, body: ChatBody | CompletionBody, http: Request, chat: bool) -> Any:
    ids = server.tokens(body)
    generation = server.request(body, ids)
    session = await server.start(generation)
    reply = _Reply(server.name, chat, len(ids))
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return EventSourceResponse(_stream(session, reply, usage), ping=15)
    return await _collect(session, reply, http)


class _Reply:
    """OpenAI response objects for one request."""

    def __init__(self, name: str, chat: bool, prompt_tokens: int) -> None:
        self.name, self.chat, self.prompt_tokens = name, chat, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, session: Session) -> dict:
        done = session.stats.new_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.name, "choices": [choice]}

    def whole(self, text: str, finish: str, session: Session) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.name,
            "choices": [choice],
            "usage": self.usage(session),
        }


async def _stream(session: Session, reply: _Reply, include_usage: bool):
    try:
        if reply.chat:
            yield json.dumps(reply.chunk("", None, first=True))
        while True:
            kind, value = await session.events.get()
            if kind == "text":
                yield json.dumps(reply.chunk(value, None))
            elif kind == "error":
                yield json.dumps({"error": {"message": value, "type": "server_error"}})
                return
            else:
                yield json.dumps(reply.chunk(None, value))
                if include_usage:
                    yield json.dumps(reply.chunk(None, None) | {"choices": [], "usage": reply.usage(session)})
                yield "[DONE]"
                return
    finally:
        session.cancel()  # the client left (or the stream ended: then nothing is left to stop)


async def _collect(session: Session, reply: _Reply, http: Request) -> dict:
    pieces = []
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(session.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise ApiError(499, "the client disconnected") from None
                continue
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                raise ApiError(500, value)
            else:
                return reply.whole("".join(pieces), value, session)
    finally:
        session.cancel()
