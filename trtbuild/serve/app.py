"""The Starlette app: OpenAI routes over one ``EngineLoop``.

``build_app(llm, config)`` returns the ASGI app; its lifespan starts the engine thread and stops it (aborting what
still runs) on shutdown. Every error is an ``APIError`` answered in OpenAI's JSON shape; an unexpected exception
in a handler becomes a 500 of the same shape, and the engine keeps serving everyone else. With
``config.access_log``, each request is logged once its response is sent (``AccessLog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import RequestError
from ..runtime.llm import LLM
from .config import ServeConfig
from .engine import EngineLoop, QueueFull, ShuttingDown, Submission
from .errors import APIError, bad_request, internal, overloaded, too_large, unauthorized, unavailable
from .metrics import ServerMetrics
from .protocol import Endpoint, ParsedRequest, parse_request
from .responses import ResponseBuilder, sse
from .tools import ToolFormat

RETRY_AFTER_S = 1
ACCESS_LOGGER = "trtbuild.serve.access"  # uvicorn's handler prints it to stderr (server.py)


class ServerState:
    """What the routes share: the engine loop, the settings and the served model's name."""

    def __init__(self, llm: LLM, config: ServeConfig, model_name: str) -> None:
        self.llm, self.config, self.model_name = llm, config, model_name
        self.metrics = ServerMetrics()
        self.engine = EngineLoop(llm, config.max_queue, self.metrics)
        self.created = int(time.time())
        self.tool_format = ToolFormat.of(llm.tokenizer)  # how the chat template takes functions (serve/tools.py)


def build_app(llm: LLM, config: ServeConfig, model_name: str) -> Starlette:
    """The ASGI app serving ``llm`` as ``model_name``."""
    state = ServerState(llm, config, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)

    async def completions(request: Request) -> Response:
        return await _generate(state, request, Endpoint.COMPLETIONS)

    async def chat(request: Request) -> Response:
        return await _generate(state, request, Endpoint.CHAT)

    async def models(request: Request) -> Response:
        _authorize(state, request)
        card = {
            "id": model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "trtbuild",
            "max_model_len": llm.config.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def metrics(request: Request) -> Response:
        body = state.metrics.render(state.engine.metrics_snapshot())
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = [Middleware(AccessLog)] if config.access_log else []
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers={Exception: _unexpected}
    )
    app.state.server = state
    return _with_api_errors(app)


class AccessLog:
    """One log line per HTTP request, once its response has been sent (a stream's at its end), like uvicorn's and
    vLLM's access log plus the time taken and, for a generation, its tokens::

        127.0.0.1:50412 - "POST /v1/chat/completions HTTP/1.1" 200 1.284s prompt_tokens=23 completion_tokens=64

    A handler that generates sets ``request.state.usage`` (a callable returning OpenAI's usage object), read when
    the response is done, so an aborted stream logs the tokens it produced. An exception no handler answered logs
    status 500.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.log = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        state = scope.setdefault("state", {})

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
            line = f'{where} - "{scope["method"]} {path} HTTP/{scope["http_version"]}" {status} '
            line += f"{time.perf_counter() - start:.3f}s"
            usage = state.get("usage")
            if usage is not None:
                counts = usage()
                line += f" prompt_tokens={counts['prompt_tokens']} completion_tokens={counts['completion_tokens']}"
            self.log.info(line)


def _with_api_errors(app: Starlette) -> Starlette:
    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return APIError(
            status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}"
        ).response()

    from starlette.exceptions import HTTPException

    app.add_exception_handler(APIError, handle)
    app.add_exception_handler(HTTPException, not_found)
    return app


async def _unexpected(request: Request, exc: Exception) -> Response:
    return internal(f"internal error ({type(exc).__name__})").response()


def _authorize(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    if key is not None and request.headers.get("authorization") != f"Bearer {key}":
        raise unauthorized()


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past ``limit`` bytes (checked while reading), 400 when it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None


async def _generate(state: ServerState, request: Request, endpoint: Endpoint) -> Response:
    _authorize(state, request)
    parsed = parse_request(await _read_json(request, state.config.max_body_bytes), endpoint, state.tool_format)
    if parsed.model is not None and parsed.model != state.model_name:
        raise bad_request(
            f"the model '{parsed.model}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )
    sub = Submission(parsed.prompts, parsed.params, endpoint is Endpoint.CHAT)
    try:
        await state.engine.submit(sub)
    except QueueFull:
        state.metrics.rejected.inc()
        raise overloaded(RETRY_AFTER_S) from None
    except ShuttingDown:
        raise unavailable() from None
    except RequestError as e:
        param = "messages" if endpoint is Endpoint.CHAT else "prompt"
        raise bad_request(str(e), param=param) from None
    builder = ResponseBuilder(
        endpoint, state.model_name, len(sub.states), sub.prompt_token_ids, state.llm.tokenizer, parsed.tools
    )
    request.state.usage = builder.usage  # the access log's tokens, read when the response is done
    if parsed.stream:
        return StreamingResponse(_stream(state, sub, builder, parsed), media_type="text/event-stream")
    return await _whole(state, sub, builder, request, parsed)


async def _whole(
    state: ServerState, sub: Submission, builder: ResponseBuilder, request: Request, parsed: ParsedRequest
) -> Response:
    """Wait for every choice to finish; a client that disconnects meanwhile aborts the request."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        remaining = len(sub.states)
        while remaining:
            get = asyncio.ensure_future(sub.queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                state.engine.abort(sub)
                return Response(status_code=499)  # nobody reads it
            for update in get.result():
                builder.add(update)
                remaining -= update.finish_reason is not None
    except BaseException:
        state.engine.abort(sub)
        raise
    finally:
        gone.cancel()
    if parsed.echo:
        for i, s in enumerate(sub.states):
            p = i // sub.params.n
            builder.echo(i, sub.prompts[p], sub.prompt_token_ids[p], s.prompt_logprobs, parsed.prompt_only)
    return JSONResponse(builder.final())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    state: ServerState, sub: Submission, builder: ResponseBuilder, parsed: ParsedRequest
) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per choice per step, the usage chunk when asked, then ``[DONE]``.

    A client that disconnects (or a cancelled response) ends this generator early: the request is aborted.
    """
    started = [False] * len(sub.states)
    remaining = len(sub.states)
    try:
        while remaining:
            for update in await sub.queue.get():
                logprobs = builder.add(update)
                first = not started[update.index]
                started[update.index] = True
                remaining -= update.finish_reason is not None
                yield sse(builder.chunk(update, logprobs, first))
        if parsed.include_usage:
            yield sse(builder.usage_chunk())
        yield sse("[DONE]")
    finally:
        if remaining:
            state.engine.abort(sub)
