"""OpenAI-compatible HTTP API: response shapes and the route handlers (request bodies are read
and checked in requests.py and turned into engine jobs in plans.py; structured output in
structured.py, tool calls in tools.py, the token routes in tokens.py).

A plain Starlette app (BentoML mounts it with `bentoml.asgi_app`), so paths, status codes and
server-sent events are exactly OpenAI's: /v1/models, /v1/completions, /v1/chat/completions; and
vLLM's /tokenize and /detokenize.
Nothing heavy runs on the event loop: tokenizing, chat template renders (themselves in worker
processes) and large JSON go to `ServerState.work`, so /livez and every stream keep flowing
while one request carries megabytes.

Each choice is one engine sequence; the engine batches all of them, across clients. A response
does not start until the first token exists, so every error that can happen before that
(validation, context overflow, a full queue) is a proper HTTP status. A client that goes away
cancels its sequences at once (see `_Guarded`).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.sampling import SamplingParams
from ..errors import CapacityError, RequestError
from . import plans
from . import requests as rq
from .plans import Plan
from .requests import error_body
from .state import ServerState
from .tools import ToolStreamParser, delta_chunks, finish_reason, parse_reply

log = logging.getLogger(__name__)

_LARGE_JSON_CHARS = 256 << 10      # a response body this large is serialised off the event loop


# ------------------------------------------------------------------------------ errors

def _error_response(state: ServerState, exc: BaseException) -> JSONResponse:
    headers = {}
    if isinstance(exc, RequestError):
        status, body = exc.status, error_body(exc.message, exc.type, exc.param, exc.code)
    elif isinstance(exc, CapacityError):
        status = 503
        body = error_body(str(exc), "server_error", None, "server_overloaded")
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s)))
    else:
        log.error("request failed", exc_info=exc)
        status, body = 500, error_body("internal error while generating", "server_error")
    if state.metrics is not None:
        state.metrics.on_http_error(status)
    return JSONResponse(body, status_code=status, headers=headers)


class _NotReady(Exception):
    pass


# ------------------------------------------------------------------------------ running

async def _merged(engine, jobs: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[tuple[int, Any]]:
    """Run every job as one engine sequence; yield (choice index, RequestOutput) as they come,
    a choice's queued outputs merged into one when the reader fell behind. Closing this
    generator cancels the pumps, whose engine generators then abort their sequences."""
    if len(jobs) == 1:
        # one choice (the usual request): read the engine directly, without a pump task between,
        # which would cost every token a second task wakeup on the event loop
        ids, params = jobs[0]
        gen = engine.generate(ids, params, request_id=f"{uuid.uuid4().hex}-0")
        try:
            async for out in gen:
                yield 0, out
        finally:
            await gen.aclose()      # aborts the sequence unless it finished
        return
    pending: collections.deque = collections.deque()
    wake = asyncio.Event()
    rid = uuid.uuid4().hex

    async def pump(i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            async for out in engine.generate(ids, params, request_id=f"{rid}-{i}"):
                pending.append((i, out, None))
                wake.set()
        except Exception as e:       # delivered to the reader; cancellation just ends the pump
            pending.append((i, None, e))
            wake.set()

    tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            while not pending:
                wake.clear()
                await wake.wait()
            i, out, err = pending.popleft()
            if err is not None:
                raise err
            while out.finish_reason is None and pending and pending[0][0] == i and pending[0][2] is None:
                out = out.merged(pending.popleft()[1])
            if out.finish_reason is not None:
                left -= 1
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Guarded:
    """ASGI response around an async generator of body chunks. Nothing is sent until the first
    chunk exists, so an exception before it becomes a JSON error with its status. A disconnect
    (seen on `receive`, or as OSError on send) cancels the generator, which frees the sequences."""

    def __init__(self, state: ServerState, body: AsyncIterator[bytes], media_type: str,
                 headers: dict[str, str] | None = None):
        self.state, self.body, self.media_type = state, body, media_type
        self.headers = headers or {}
        self.started = False

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                log.debug("client disconnected; cancelling its sequences")
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self._respond(scope, receive, send)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.body.aclose()
                tg.cancel_scope.cancel()
        if not self.started:
            # The client left before any response. Something must still be sent: BentoML's
            # timeout middleware waits for a first send, and would hold the request (and a
            # graceful shutdown) until its timeout.
            try:
                await _client_closed_response()(scope, receive, send)
            except Exception:  # the connection is gone; failing to write to it is expected
                pass

    async def _respond(self, scope, receive, send) -> None:
        try:
            first = await self.body.__anext__()
        except StopAsyncIteration:
            first = _Last()
        except Exception as e:
            self.started = True
            await _error_response(self.state, e)(scope, receive, send)
            return
        headers = [(b"content-type", self.media_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        try:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            chunk = first
            while type(chunk) is not _Last:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                try:
                    chunk = await self.body.__anext__()
                except StopAsyncIteration:
                    chunk = _Last()
            # the body's last bytes end the response in the same send (one write, not two)
            await send({"type": "http.response.body", "body": chunk, "more_body": False})
        except OSError:
            log.debug("client went away mid-response")


class _Last(bytes):
    """A body's final bytes: nothing follows them (see _Guarded)."""


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)).encode() + b"\n\n"


_HOLE = "\ue000realizar-text\ue000"     # where a chunk template's text goes (a private-use mark)


class _ChunkTemplate:
    """The SSE bytes of one kind of chunk whose only varying field is a text, `make(text)` being
    its dict: encoded once per stream with a mark in the text's place, then each chunk is the
    bytes around the mark with the text JSON-encoded between them. json.dumps encodes a string
    inside a dict exactly as on its own, so the bytes equal _sse(make(text)): one string encoding
    per token instead of a dict's (and its nested lists' and dicts')."""
    __slots__ = ("make", "head", "tail")

    def __init__(self, make):
        self.make = make
        parts = _sse(make(_HOLE)).split(json.dumps(_HOLE, ensure_ascii=False).encode())
        # the mark elsewhere too (a model named with it): every chunk goes the dict's way
        self.head, self.tail = parts if len(parts) == 2 else (None, None)

    def __call__(self, text: str) -> bytes:
        if self.head is None:
            return _sse(self.make(text))
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(reason: str | None) -> str | None:
    # a sequence cut short by the server's shutdown reads as "length" (the output is incomplete);
    # "abort" only reaches a client whose request was cancelled server-side; report it as stop
    return None if reason is None else ("length" if reason in ("length", "shutdown") else "stop")


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


def _chat_logprobs(entries) -> list[dict]:
    def one(t, v):
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
    return [{**one(t, lp), "top_logprobs": [one(tt, vv) for tt, vv in top]} for t, lp, top in entries or []]


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
            except rq.ClientGone as e:
                log.info("%s %s: %s", request.method, request.url.path, e)
                return _client_closed_response()
            except Exception as e:       # typed errors keep their status; anything else is a logged 500
                return _error_response(state, e)
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
        plan = await plans.planned(state, request.receive, plans.completion_plan, raw, engine, state.settings)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if plan.stream:
            return _Guarded(state, _stream_completion(engine, plan, head), "text/event-stream", SSE_HEADERS)
        return _Guarded(state, _full_completion(state, engine, plan, head), "application/json")

    async def chat(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await plans.planned(state, request.receive, plans.chat_plan, raw, engine, state.settings)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "created": created, "model": engine.model_name}
        if plan.stream:
            return _Guarded(state, _stream_chat(engine, plan, head), "text/event-stream", SSE_HEADERS)
        return _Guarded(state, _full_chat(state, engine, plan, head), "application/json")

    async def tokenize(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        out = await state.offload(plans.tokenize, raw, engine)
        return Response(await _dumps(state, out, 8 * out["count"]), media_type="application/json")

    async def detokenize(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        out = await state.offload(plans.detokenize, raw, engine)
        return Response(await _dumps(state, out, len(out["prompt"])), media_type="application/json")

    routes = [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
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
    """Counts the /v1 requests in flight (a graceful shutdown waits for them) and, once the
    server drains, answers new ones 503 with Retry-After at once."""

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
            await self.app(scope, receive, send)
        finally:
            self.state.active -= 1


def _client_closed_response() -> Response:
    # nobody reads it; BentoML's middlewares wait for a response to close the request.
    # 499 is nginx's "client closed request".
    return JSONResponse(error_body("client closed the request", code="client_closed_request"), status_code=499)


async def _collect(engine, jobs):
    texts = [""] * len(jobs)
    reasons: list[str | None] = [None] * len(jobs)
    lps: list[list] = [[] for _ in jobs]
    done_tokens = [0] * len(jobs)
    async for i, out in _merged(engine, jobs):
        texts[i] += out.text
        lps[i].extend(out.logprobs or [])
        done_tokens[i] = out.completion_tokens
        if out.finish_reason is not None:
            reasons[i] = out.finish_reason
    return texts, reasons, lps, sum(done_tokens)


async def _dumps(state: ServerState, obj: dict, size: int) -> bytes:
    def dump() -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()
    return dump() if size < _LARGE_JSON_CHARS else await state.offload(dump)


async def _full_completion(state, engine, plan: Plan, head) -> AsyncIterator[bytes]:
    texts, reasons, lps, completion_tokens = await _collect(engine, plan.jobs)
    choices = []
    for i, text in enumerate(texts):
        lp = _CompletionLogprobs().add(lps[i]) if plan.logprobs else None
        if plan.echo is not None:
            text = plan.echo[i] + text
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(reasons[i])})
    yield _Last(await _dumps(state, {**head, "choices": choices, "usage": _usage(plan.prompt_tokens, completion_tokens)},
                             sum(map(len, texts))))


def _message(plan: Plan, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A whole reply as OpenAI's chat message and finish_reason: with tools, the calls parsed
    out of the text into tool_calls (content null when the reply is only calls)."""
    if not plan.calls_tools:
        return {"role": "assistant", "content": text}, _finish(reason)
    content, calls = parse_reply(text, plan.tools)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg, finish_reason(_finish(reason), len(calls))


async def _full_chat(state, engine, plan: Plan, head) -> AsyncIterator[bytes]:
    texts, reasons, lps, completion_tokens = await _collect(engine, plan.jobs)
    choices = []
    for i, text in enumerate(texts):
        msg, reason = _message(plan, text, reasons[i])
        choices.append({"index": i, "message": msg,
                        "logprobs": {"content": _chat_logprobs(lps[i])} if plan.logprobs else None,
                        "finish_reason": reason})
    yield _Last(await _dumps(state, {**head, "object": "chat.completion", "choices": choices,
                                     "usage": _usage(plan.prompt_tokens, completion_tokens)}, sum(map(len, texts))))


async def _stream(engine, plan: Plan, head, make_choices) -> AsyncIterator[bytes]:
    """SSE framing shared by both endpoints: the chunks of each engine output (make_choices gives
    their choices), then usage and [DONE]. An error after the stream started can only be
    reported in-band."""
    tokens_out = [0] * len(plan.jobs)
    sent = False
    left = len(plan.jobs)
    end: list[bytes] = []         # the last choice's final chunks, sent with usage and [DONE]
    try:
        async for i, out in _merged(engine, plan.jobs):
            tokens_out[i] = out.completion_tokens
            chunks = make_choices(i, out)
            if type(chunks) is not bytes:       # a template's chunk (the usual one) or choice dicts
                chunks = b"".join(_sse({**head, "choices": [choice]}) for choice in chunks)
            if out.finish_reason is not None:
                left -= 1
                if not left:          # the stream's end: nothing follows but usage and [DONE]
                    end.append(chunks)
                    continue
            if chunks:
                sent = True
                yield chunks
    except Exception as e:
        if not sent and not end:
            raise                 # nothing sent yet: _Guarded turns it into an HTTP error status
        if not isinstance(e, (RequestError, CapacityError)):
            log.error("stream failed after it started", exc_info=e)
        end.append(_sse(error_body(str(e), getattr(e, "type", "server_error"))))
    if plan.include_usage:
        end.append(_sse({**head, "choices": [], "usage": _usage(plan.prompt_tokens, sum(tokens_out))}))
    end.append(_sse("[DONE]"))
    yield _Last(b"".join(end))


def _stream_completion(engine, plan: Plan, head):
    lps = [_CompletionLogprobs() for _ in plan.jobs]
    echoed = [plan.echo is None] * len(plan.jobs)
    plain = [_ChunkTemplate(lambda text, i=i: {**head, "choices": [{"index": i, "text": text, "logprobs": None,
                                                                    "finish_reason": None}]})
             for i in range(len(plan.jobs))]

    def choices(i, out):
        text = out.text
        if not echoed[i]:
            text, echoed[i] = plan.echo[i] + text, True
        if out.finish_reason is None and out.logprobs is None:
            return plain[i](text) if text else b""
        if not text and out.finish_reason is None and not out.logprobs:
            return []
        lp = lps[i].add(out.logprobs) if out.logprobs is not None else None
        return [{"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(out.finish_reason)}]
    return _stream(engine, plan, head, choices)


def _stream_chat(engine, plan: Plan, head):
    head = {**head, "object": "chat.completion.chunk"}
    started = [False] * len(plan.jobs)
    parsers = [ToolStreamParser(plan.tools) for _ in plan.jobs] if plan.calls_tools else None

    plain = [_ChunkTemplate(lambda text, i=i: {**head, "choices": [{"index": i, "delta": {"content": text},
                                                                    "logprobs": None, "finish_reason": None}]})
             for i in range(len(plan.jobs))]

    def choices(i, out):
        if parsers is None and started[i] and out.finish_reason is None and out.logprobs is None:
            return plain[i](out.text) if out.text else b""
        lp = {"content": _chat_logprobs(out.logprobs)} if out.logprobs is not None else None
        reason = _finish(out.finish_reason)
        if parsers is None:
            deltas = [{"content": out.text}] if out.text else []
        else:
            # text becomes content and tool_calls deltas as the parser sees calls in it
            p = parsers[i]
            deltas = delta_chunks(p.feed(out.text) + (p.finish() if reason is not None else []))
            reason = finish_reason(reason, p.n_calls)
        if not started[i]:
            started[i] = True      # OpenAI's first delta of a choice names the role
            first = deltas[0] if deltas else {}
            deltas[:1] = [{"role": "assistant", "content": first.get("content", "" if parsers is None else None),
                           **{k: v for k, v in first.items() if k != "content"}}]
        if not deltas and (reason is not None or out.logprobs):
            deltas = [{}]
        return [{"index": i, "delta": d, "logprobs": lp if k == len(deltas) - 1 else None,
                 "finish_reason": reason if k == len(deltas) - 1 else None} for k, d in enumerate(deltas)]
    return _stream(engine, plan, head, choices)
