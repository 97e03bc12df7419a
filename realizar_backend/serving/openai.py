"""OpenAI-compatible HTTP API: the route handlers and completions' answers (request bodies are
read and checked in requests.py and turned into engine jobs in plans.py; structured output in
structured.py, tool calls in tools.py, reasoning in reasoning.py, chat's answers in chat.py, the
token routes in tokens.py; streaming.py has what every route answers with).

A plain Starlette app (BentoML mounts it with `bentoml.asgi_app`), so paths, status codes and
server-sent events are exactly OpenAI's: /v1/models, /v1/completions, /v1/chat/completions; and
vLLM's /tokenize, /detokenize, /health and /version.
Nothing heavy runs on the event loop: tokenizing, chat template renders (themselves in worker
processes) and large JSON go to `ServerState.work`, so /livez and every stream keep flowing
while one request carries megabytes.

Each choice is one engine sequence; the engine batches all of them, across clients. A response
does not start until the first token exists, so every error that can happen before that
(validation, context overflow, a full queue) is a proper HTTP status. A client that goes away
cancels its sequences at once (see `streaming.Guarded`). A request whose response has not started
within Settings.request_timeout_s is ended with a 504 (see `_InFlight`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from ..errors import RequestError
from . import plans
from . import requests as rq
from .chat import full_chat, stream_chat
from .plans import Plan
from .requests import error_body
from .state import ServerState
from .streaming import (SSE_HEADERS, ChunkTemplate, Guarded, Last, client_closed_response, collect, dumps,
                        error_response, finish, stream, usage)

log = logging.getLogger(__name__)


class _NotReady(Exception):
    pass


class _CompletionLogprobs:
    """The legacy completions logprobs object, built token by token."""

    def __init__(self):
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.offset = 0

    def add(self, entries) -> dict:
        start = len(self.tokens)
        for text, lp, top in entries or []:
            self.tokens.append(text)
            self.token_logprobs.append(lp)
            self.top_logprobs.append({t: v for t, v in top})
            self.text_offset.append(self.offset)
            self.offset += len(text)
        return self.as_dict(start)

    def as_dict(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


# ------------------------------------------------------------------------------ routes

def create_app(state: ServerState) -> Starlette:
    """The OpenAI routes over `state`; the service mounts this at /."""

    def authorize(request: Request) -> None:
        key = state.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not given or not hmac.compare_digest(given.encode(), key.encode()):
            raise RequestError("missing or incorrect API key; send `Authorization: Bearer <key>`",
                               status=401, code="invalid_api_key")

    def ready_engine():
        if state.engine is None:
            msg = "the model is still loading" if state.load_error is None else \
                f"this worker cannot serve the model: {state.load_error}"
            raise _NotReady(msg)
        return state.engine

    def endpoint(fn):
        async def handler(request: Request):
            try:
                authorize(request)
                return await fn(request, ready_engine())
            except _NotReady as e:
                if state.metrics is not None:
                    state.metrics.on_http_error(503)
                # a new connection may reach another worker that is ready (serving/service.py)
                return JSONResponse(error_body(str(e), "server_error", None, "model_not_ready"),
                                    status_code=503, headers={"Retry-After": "5", "Connection": "close"})
            except rq.ClientGone:
                log.info("%s %s: the client left while sending its request body", request.method,
                         request.url.path)
                return client_closed_response()
            except Exception as e:       # typed errors keep their status; anything else is a logged 500
                return error_response(state, e)
        return handler

    def model_card(engine) -> dict:
        return {"id": engine.model_name, "object": "model", "created": int(state.started),
                "owned_by": "realizar", "max_model_len": engine.max_context}

    async def list_models(request: Request, engine) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(engine)]})

    async def get_model(request: Request, engine) -> Response:
        if request.path_params["model"] != engine.model_name:
            raise RequestError(f"the model {request.path_params['model']!r} does not exist", status=404,
                               param="model", code="model_not_found")
        return JSONResponse(model_card(engine))

    async def completions(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await state.offload(plans.completion_plan, raw, engine, state.settings)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if plan.stream:
            return Guarded(state, _stream_completion(engine, plan, head), "text/event-stream", SSE_HEADERS)
        return Guarded(state, _full_completion(state, engine, plan, head), "application/json")

    async def chat(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await state.offload(plans.chat_plan, raw, engine, state.settings)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "created": created, "model": engine.model_name}
        if plan.stream:
            return Guarded(state, stream_chat(engine, plan, head), "text/event-stream", SSE_HEADERS)
        return Guarded(state, full_chat(state, engine, plan, head), "application/json")

    async def tokenize(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        out = await state.offload(plans.tokenize, raw, engine)
        return Response(await dumps(state, out, 8 * out["count"]), media_type="application/json")

    async def detokenize(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        out = await state.offload(plans.detokenize, raw, engine)
        return Response(await dumps(state, out, len(out["prompt"])), media_type="application/json")

    async def health(request: Request) -> Response:
        # vLLM's: 200 (empty) while the server can serve (as /readyz), 503 while it loads, when no
        # engine can serve (failed, gone or stuck) and while it drains
        engine = state.engine
        ok = (engine is not None and not state.draining and getattr(engine, "alive", True)
              and (getattr(engine, "stall", None) is None or engine.stall() is None))
        return Response(status_code=200 if ok else 503)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    routes = [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    known = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST"}

    async def fallback(request: Request) -> Response:
        # BentoML answers unmatched paths itself (plain text); catching /v1/* here keeps
        # OpenAI's error shape for unknown routes and wrong methods
        path = request.url.path.rstrip("/")
        if path in known or path.startswith("/v1/models/"):
            raise HTTPException(405, f"method not allowed (use {known.get(path, 'GET')})")
        raise HTTPException(404, "no such route")

    routes.append(Route("/v1/{rest:path}", fallback,
                        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]))

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # unknown paths and wrong methods keep OpenAI's error shape too
        if state.metrics is not None:
            state.metrics.on_http_error(exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", param=None,
                                       code=code), status_code=exc.status_code, headers=exc.headers)

    return _InFlight(Starlette(routes=routes, exception_handlers={HTTPException: http_error}), state)


class _InFlight:
    """Counts the /v1 requests in flight (a graceful shutdown waits for them); once the server
    drains, answers new ones 503 with Retry-After at once; and ends a request whose response has
    not started within Settings.request_timeout_s (its sequences cancelled) with a 504."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1"):
            return await self.app(scope, receive, send)
        if self.state.draining:
            if self.state.metrics is not None:
                self.state.metrics.on_http_error(503)
            response = JSONResponse(error_body("the server is shutting down; retry on another replica",
                                               "server_error", None, "server_shutting_down"),
                                    status_code=503, headers={"Retry-After": "5", "Connection": "close"})
            return await response(scope, receive, send)
        self.state.active += 1
        try:
            await self._within_limit(scope, receive, send)
        finally:
            self.state.active -= 1

    async def _within_limit(self, scope, receive, send) -> None:
        started = asyncio.Event()

        async def send_started(message) -> None:
            if message["type"] == "http.response.start":
                started.set()
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, send_started))
        waiter = asyncio.ensure_future(started.wait())
        limit = self.state.settings.request_timeout_s
        try:
            await asyncio.wait((task, waiter), timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:    # the server stops this request: the route's task with it
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done() or started.is_set():
            return await task
        task.cancel()                     # the route's generator closes: its sequences are aborted
        await asyncio.gather(task, return_exceptions=True)
        if started.is_set():              # it began to answer while it was being stopped
            return
        log.warning("%s %s: no response within %g s (REALIZAR_REQUEST_TIMEOUT_S); ended with 504",
                    scope.get("method"), scope.get("path"), limit)
        if self.state.metrics is not None:
            self.state.metrics.on_http_error(504)
        response = JSONResponse(error_body(f"the request did not complete within {limit:g} s (this server's "
                                           f"REALIZAR_REQUEST_TIMEOUT_S)", "server_error", None, "response_timeout"),
                                status_code=504)
        await response(scope, receive, send)


async def _full_completion(state, engine, plan: Plan, head) -> AsyncIterator[bytes]:
    got = await collect(engine, plan.jobs)
    choices = []
    for i, text in enumerate(got.texts):
        lp = _CompletionLogprobs().add(got.logprobs[i]) if plan.logprobs else None
        if plan.echo is not None:
            text = plan.echo[i] + text
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish(got.reasons[i])})
    body = {**head, "choices": choices, "usage": usage(plan.prompt_tokens, sum(got.completion_tokens),
                                                       plan.cached_tokens(got.cached_tokens))}
    yield Last(await dumps(state, body, sum(map(len, got.texts))))


def _stream_completion(engine, plan: Plan, head):
    lps = [_CompletionLogprobs() for _ in plan.jobs]
    echoed = [plan.echo is None] * len(plan.jobs)
    plain = None if plan.continuous_usage else [
        ChunkTemplate(lambda text, i=i: {**head, "choices": [{"index": i, "text": text, "logprobs": None,
                                                              "finish_reason": None}]})
        for i in range(len(plan.jobs))]

    def choices(i, out):
        text = out.text
        if not echoed[i]:
            text, echoed[i] = plan.echo[i] + text, True
        if plain is not None and out.finish_reason is None and out.logprobs is None:
            return plain[i](text) if text else b""
        if not text and out.finish_reason is None and not out.logprobs:
            return []
        lp = lps[i].add(out.logprobs) if out.logprobs is not None else None
        return [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish(out.finish_reason)}]
    return stream(engine, plan, head, choices)
