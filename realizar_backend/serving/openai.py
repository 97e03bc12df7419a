"""OpenAI-compatible HTTP API: the route handlers and completions' answers (request bodies are
read and checked in requests.py and turned into engine jobs in plans.py; structured output in
structured.py, tool calls in tools.py, reasoning in reasoning.py, chat's answers in chat.py, the
token routes in tokens.py; streaming.py has what every route answers with, handlers.py the API
key, readiness and requests in flight; app.py puts every API's routes together).

Paths, status codes and server-sent events are exactly OpenAI's: /v1/models, /v1/completions,
/v1/chat/completions; and vLLM's /tokenize, /detokenize, /health and /version.
Nothing heavy runs on the event loop: tokenizing, chat template renders (themselves in worker
processes) and large JSON go to `ServerState.work`, so /livez and every stream keep flowing
while one request carries megabytes. Only a small completions body without a grammar is planned
on the loop, where it costs less than the trip to a worker thread (plans.INLINE_PLAN_BYTES).

Each choice is one engine sequence; the engine batches all of them, across clients. A response
does not start until the first token exists, so every error that can happen before that
(validation, context overflow, a full queue) is a proper HTTP status. A client that goes away
cancels its sequences at once (see `streaming.Guarded`). A request whose response has not started
within Settings.request_timeout_s is ended with a 504 (see `handlers.InFlight`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from ..errors import RequestError
from . import plans
from . import requests as rq
from .chat import full_chat, stream_chat
from .plans import Plan
from .state import ServerState
from .streaming import SSE_HEADERS, ChunkTemplate, Guarded, Last, collect, dumps, finish, stream, usage

log = logging.getLogger(__name__)


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

def routes(state: ServerState, endpoint) -> list[Route]:
    """The OpenAI routes over `state` (endpoint: handlers.make_endpoint's wrapper)."""

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
        plan = await plans.completion(state, request.receive, raw, engine)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if plan.stream:
            return Guarded(state, _stream_completion(engine, plan, head), "text/event-stream", SSE_HEADERS)
        return Guarded(state, _full_completion(state, engine, plan, head), "application/json")

    async def chat(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await plans.planned(state, request.receive, plans.chat_plan, raw, engine, state.settings)
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

    return [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]


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
