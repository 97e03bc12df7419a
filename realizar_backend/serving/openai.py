"""OpenAI-compatible HTTP API: request parsing, response shapes and the route handlers.

A plain Starlette app (BentoML mounts it with `bentoml.asgi_app`), so paths, status codes and
server-sent events are exactly OpenAI's: /v1/models, /v1/completions, /v1/chat/completions.
Requests are parsed by hand rather than through a schema library so that every bad field
becomes a 400 naming that field (`param`), in OpenAI's error shape, never a 422 or a 500.

Each choice is one engine sequence; the engine batches all of them, across clients. A response
does not start until the first token exists, so every error that can happen before that
(validation, context overflow, a full queue) is a proper HTTP status. A client that goes away
cancels its sequences at once (see `_Guarded`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from ..errors import CapacityError, RequestError

log = logging.getLogger(__name__)

MAX_N = 16                   # choices per request (each is a sequence)
MAX_SEQUENCES = 64           # choices x prompts per request
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class ServerState:
    """What the routes need; filled in by the service once the model is loaded."""
    settings: Any
    engine: Any = None                    # realizar_backend.engine.engine.Engine once loaded
    metrics: Any = None                   # serving.metrics.Metrics
    load_error: str | None = None
    started: float = 0.0


# ------------------------------------------------------------------------------ errors

def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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


def _bad(param: str | None, message: str, code: str | None = None) -> RequestError:
    return RequestError(message, status=400, param=param, code=code)


class _NotReady(Exception):
    pass


# ------------------------------------------------------------------------------ parsing

_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or an array of strings"),
    "ints": (lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v),
             "an array of integers"),
}


class _Body:
    """Typed access to a JSON request body; a missing or null field takes its default."""

    def __init__(self, data: dict):
        self.data = data

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        v = self.data.get(name)
        if v is None:
            return default
        ok, what = _KINDS[kind]
        if not ok(v):
            raise _bad(name, f"{name}: expected {what}, got {type(v).__name__} {json.dumps(v)[:60]}",
                       "invalid_type")
        return v

    def require(self, name: str, kind: str) -> Any:
        v = self.get(name, kind)
        if v is None:
            raise _bad(name, f"{name}: this field is required", "missing_required_parameter")
        return v

    def unsupported(self, name: str, allowed: Callable[[Any], bool] = lambda v: not v) -> None:
        v = self.data.get(name)
        if v is not None and not allowed(v):
            raise _bad(name, f"{name}: not supported by this server", "unsupported_parameter")


async def _read_json(request: Request) -> _Body:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _bad(None, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise _bad(None, "the request body must be a JSON object", "invalid_json")
    return _Body(data)


def _check_model(body: _Body, engine) -> None:
    model = body.require("model", "str")
    if model != engine.model_name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
                           status=400, param="model", code="model_not_found")


def _sampling(body: _Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's sampling fields under their OpenAI names (and vLLM's for the extras);
    ranges are checked by SamplingParams.validate inside engine.prepare."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.get("temperature", "number", 1.0),
        top_p=body.get("top_p", "number", 1.0),
        top_k=body.get("top_k", "int", 0),
        min_p=body.get("min_p", "number", 0.0),
        repetition_penalty=body.get("repetition_penalty", "number", 1.0),
        presence_penalty=body.get("presence_penalty", "number", 0.0),
        frequency_penalty=body.get("frequency_penalty", "number", 0.0),
        seed=body.get("seed", "int"),
        stop=body.get("stop", "stop", []),
        stop_token_ids=body.get("stop_token_ids", "ints", []),
        ignore_eos=body.get("ignore_eos", "bool", False),
        logprobs=logprobs,
    )


def _n(body: _Body, prompts: int) -> int:
    n = body.get("n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise _bad("n", f"n: must be between 1 and {MAX_N}, got {n}")
    if n * prompts > MAX_SEQUENCES:
        raise _bad("n", f"n x prompts must be at most {MAX_SEQUENCES}, got {n * prompts}")
    return n


def _stream_options(body: _Body, stream: bool) -> bool:
    opts = body.get("stream_options", "dict")
    if opts is None:
        return False
    if not stream:
        raise _bad("stream_options", "stream_options: only allowed when stream is true")
    inc = opts.get("include_usage", False)
    if not isinstance(inc, bool):
        raise _bad("stream_options", "stream_options.include_usage: expected a boolean", "invalid_type")
    return inc


def _prompts(body: _Body) -> list[str | list[int]]:
    p = body.data.get("prompt")
    if p is None:
        raise _bad("prompt", "prompt: this field is required", "missing_required_parameter")
    if isinstance(p, str) or _KINDS["ints"][0](p) and p:
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or (_KINDS["ints"][0](x) and x) for x in p):
        return list(p)
    raise _bad("prompt", "prompt: expected a string, an array of strings, an array of token ids "
                         "or an array of arrays of token ids", "invalid_type")


def _messages(body: _Body) -> list[dict]:
    msgs = body.require("messages", "list")
    if not msgs:
        raise _bad("messages", "messages: must contain at least one message")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"{where}: expected an object", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"{where}.role: must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"{where}.content", f"{where}.content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{where}.content", f"{where}.content: expected a string or an array of text parts",
                       "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# ------------------------------------------------------------------------------ running

async def _merged(engine, jobs: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[tuple[int, Any]]:
    """Run every job as one engine sequence; yield (choice index, RequestOutput) as they come,
    a choice's queued outputs merged into one when the reader fell behind. Closing this
    generator cancels the pumps, whose engine generators then abort their sequences."""
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
            # graceful shutdown) until its timeout. 499 is nginx's "client closed request".
            try:
                await send({"type": "http.response.start", "status": 499,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": json.dumps(
                    error_body("client closed the request", code="client_closed_request")).encode()})
            except Exception:  # the connection is gone; failing to write to it is expected
                pass

    async def _respond(self, scope, receive, send) -> None:
        try:
            first = await self.body.__anext__()
        except StopAsyncIteration:
            first = b""
        except Exception as e:
            self.started = True
            await _error_response(self.state, e)(scope, receive, send)
            return
        headers = [(b"content-type", self.media_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        try:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            log.debug("client went away mid-response")


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)).encode() + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(reason: str | None) -> str | None:
    # "abort" only reaches a client whose request was cancelled server-side; report it as stop
    return None if reason is None else ("length" if reason == "length" else "stop")


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
                f"the model failed to load: {state.load_error}"
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
                return JSONResponse(error_body(str(e), "server_error", None, "model_not_ready"),
                                    status_code=503, headers={"Retry-After": "5"})
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
        body = await _read_json(request)
        _check_model(body, engine)
        for name in ("suffix", "logit_bias"):
            body.unsupported(name)
        body.unsupported("echo", lambda v: v is False)
        prompts = _prompts(body)
        n = _n(body, len(prompts))
        body.unsupported("best_of", lambda v: v == n)
        stream = body.get("stream", "bool", False)
        include_usage = _stream_options(body, stream)
        logprobs = body.get("logprobs", "int")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise _bad("logprobs", f"logprobs: must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
        max_tokens = body.get("max_tokens", "int", 16)
        jobs, prompt_tokens = _jobs(engine, body, prompts, n, max_tokens, logprobs)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if stream:
            return _Guarded(state, _stream_completion(engine, jobs, head, prompt_tokens, include_usage),
                            "text/event-stream", SSE_HEADERS)
        return _Guarded(state, _full_completion(engine, jobs, head, prompt_tokens, logprobs is not None),
                        "application/json")

    async def chat(request: Request, engine) -> Response:
        body = await _read_json(request)
        _check_model(body, engine)
        for name in ("tools", "functions", "logit_bias", "audio"):
            body.unsupported(name)
        body.unsupported("tool_choice", lambda v: v == "none")
        body.unsupported("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")
        messages = _messages(body)
        n = _n(body, 1)
        stream = body.get("stream", "bool", False)
        include_usage = _stream_options(body, stream)
        want_lp = body.get("logprobs", "bool", False)
        top = body.get("top_logprobs", "int")
        if top is not None and not want_lp:
            raise _bad("top_logprobs", "top_logprobs: requires logprobs to be true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise _bad("top_logprobs", f"top_logprobs: must be between 0 and {MAX_LOGPROBS}, got {top}")
        max_tokens = body.get("max_completion_tokens", "int")
        if max_tokens is None:
            max_tokens = body.get("max_tokens", "int")
        if not getattr(engine.tokenizer, "has_chat_template", True):
            raise _bad("messages", "this model has no chat template; use /v1/completions")
        jobs, prompt_tokens = _jobs(engine, body, [None], n, max_tokens,
                                    (top or 0) if want_lp else None, messages=messages)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "created": created, "model": engine.model_name}
        if stream:
            return _Guarded(state, _stream_chat(engine, jobs, head, prompt_tokens, include_usage),
                            "text/event-stream", SSE_HEADERS)
        return _Guarded(state, _full_chat(engine, jobs, head, prompt_tokens, want_lp), "application/json")

    routes = [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
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

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _jobs(engine, body: _Body, prompts, n: int, max_tokens, logprobs, messages=None):
    """Validate and tokenize every prompt once, then one job (sequence) per choice; seeded
    choices get seed + i so that n > 1 gives n different, reproducible samples."""
    jobs, prompt_tokens = [], 0
    for prompt in prompts:
        params = _sampling(body, max_tokens, logprobs)
        ids = engine.prepare(prompt, params, messages)
        prompt_tokens += len(ids)
        for i in range(n):
            p = dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)
            jobs.append((ids, p))
    return jobs, prompt_tokens


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


async def _full_completion(engine, jobs, head, prompt_tokens, with_lp) -> AsyncIterator[bytes]:
    texts, reasons, lps, completion_tokens = await _collect(engine, jobs)
    choices = []
    for i, text in enumerate(texts):
        lp = _CompletionLogprobs().add(lps[i]) if with_lp else None
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(reasons[i])})
    yield json.dumps({**head, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)},
                     ensure_ascii=False).encode()


async def _full_chat(engine, jobs, head, prompt_tokens, with_lp) -> AsyncIterator[bytes]:
    texts, reasons, lps, completion_tokens = await _collect(engine, jobs)
    choices = [{"index": i, "message": {"role": "assistant", "content": text},
                "logprobs": {"content": _chat_logprobs(lps[i])} if with_lp else None,
                "finish_reason": _finish(reasons[i])} for i, text in enumerate(texts)]
    yield json.dumps({**head, "object": "chat.completion", "choices": choices,
                      "usage": _usage(prompt_tokens, completion_tokens)}, ensure_ascii=False).encode()


async def _stream(engine, jobs, prompt_tokens, include_usage, head, make_choice) -> AsyncIterator[bytes]:
    """SSE framing shared by both endpoints: one chunk per engine output, then usage and [DONE].
    An error after the stream started can only be reported in-band."""
    tokens = [0] * len(jobs)
    sent = False
    try:
        async for i, out in _merged(engine, jobs):
            tokens[i] = out.completion_tokens
            choice = make_choice(i, out)
            if choice is not None:
                sent = True
                yield _sse({**head, "choices": [choice]})
    except Exception as e:
        if not sent:
            raise                 # nothing sent yet: _Guarded turns it into an HTTP error status
        if not isinstance(e, (RequestError, CapacityError)):
            log.error("stream failed after it started", exc_info=e)
        yield _sse(error_body(str(e), getattr(e, "type", "server_error")))
    if include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, sum(tokens))})
    yield _sse("[DONE]")


def _stream_completion(engine, jobs, head, prompt_tokens, include_usage):
    lps = [_CompletionLogprobs() for _ in jobs]

    def choice(i, out):
        if not out.text and out.finish_reason is None and not out.logprobs:
            return None
        lp = lps[i].add(out.logprobs) if out.logprobs is not None else None
        return {"index": i, "text": out.text, "logprobs": lp, "finish_reason": _finish(out.finish_reason)}
    return _stream(engine, jobs, prompt_tokens, include_usage, head, choice)


def _stream_chat(engine, jobs, head, prompt_tokens, include_usage):
    head = {**head, "object": "chat.completion.chunk"}
    started = [False] * len(jobs)

    def choice(i, out):
        delta: dict[str, Any] = {}
        if not started[i]:
            delta["role"] = "assistant"       # OpenAI's first delta of a choice names the role
            started[i] = True
        if out.text or "role" in delta:
            delta["content"] = out.text
        if not delta and out.finish_reason is None and not out.logprobs:
            return None
        lp = {"content": _chat_logprobs(out.logprobs)} if out.logprobs is not None else None
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": _finish(out.finish_reason)}
    return _stream(engine, jobs, prompt_tokens, include_usage, head, choice)
