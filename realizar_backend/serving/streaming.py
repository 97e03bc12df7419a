"""How an API route answers from engine outputs, whatever the API: the choices' sequences run
together (`merged`), a response that starts only once its first bytes exist (`Guarded`, so that
every error before then is a proper HTTP status), server-sent events (`sse`, `ChunkTemplate`, the
OpenAI framing in `stream`), usage objects, and JSON bodies serialised off the event loop when
large (`dumps`). The OpenAI routes (openai.py, chat.py) and the other APIs' routes share these.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from starlette.responses import JSONResponse, Response

from ..engine.sampling import SamplingParams
from ..errors import CapacityError, RequestError
from .requests import error_body
from .state import ServerState

log = logging.getLogger(__name__)

LARGE_JSON_CHARS = 256 << 10      # a response body this large is serialised off the event loop
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ------------------------------------------------------------------------------ errors

ANTHROPIC_PATHS = "/v1/messages"   # the routes that speak Anthropic's API (and its error shape)
# Anthropic's error type for each status it uses (anything else: api_error)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
                    503: "overloaded_error", 504: "api_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_json(path: str, status: int, message: str, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    """An error response in the shape of the API that `path` belongs to: OpenAI's
    `{"error": {"message", "type", "param", "code"}}`, or under /v1/messages Anthropic's
    `{"type": "error", "error": {"type", "message"}}` with the type Anthropic gives the status."""
    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(state: ServerState, exc: BaseException, path: str = "") -> JSONResponse:
    """An exception as the error body and status of the API `path` belongs to (typed errors keep
    theirs; anything else is a logged 500), counted in the error metric."""
    headers = {}
    if isinstance(exc, RequestError):
        status, args = exc.status, (exc.message, exc.type, exc.param, exc.code)
    elif isinstance(exc, CapacityError):
        status, args = 503, (str(exc), "server_error", None, "server_overloaded")
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s)))
    else:
        log.error("request failed", exc_info=exc)
        status, args = 500, ("internal error while generating", "server_error", None, None)
    if state.metrics is not None:
        state.metrics.on_http_error(status)
    return error_json(path, status, *args, headers=headers)


def client_closed_response() -> Response:
    # nobody reads it; BentoML's middlewares wait for a response to close the request.
    # 499 is nginx's "client closed request".
    return JSONResponse(error_body("client closed the request", code="client_closed_request"), status_code=499)


# ------------------------------------------------------------------------------ running

async def merged(engine, jobs: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[tuple[int, Any]]:
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


@dataclass
class Collected:
    """Every choice's whole output."""
    texts: list[str]
    reasons: list[str | None]
    logprobs: list[list]
    completion_tokens: list[int]
    cached_tokens: list[int] = field(default_factory=list)


async def collect(engine, jobs) -> Collected:
    n = len(jobs)
    c = Collected([""] * n, [None] * n, [[] for _ in jobs], [0] * n, [0] * n)
    async for i, out in merged(engine, jobs):
        c.texts[i] += out.text
        c.logprobs[i].extend(out.logprobs or [])
        c.completion_tokens[i] = out.completion_tokens
        c.cached_tokens[i] = max(c.cached_tokens[i], out.cached_tokens)
        if out.finish_reason is not None:
            c.reasons[i] = out.finish_reason
    return c


class Guarded:
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
                await client_closed_response()(scope, receive, send)
            except Exception:  # the connection is gone; failing to write to it is expected
                pass

    async def _respond(self, scope, receive, send) -> None:
        try:
            first = await self.body.__anext__()
        except StopAsyncIteration:
            first = Last()
        except Exception as e:
            self.started = True
            await error_response(self.state, e, scope.get("path", ""))(scope, receive, send)
            return
        headers = [(b"content-type", self.media_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        try:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            chunk = first
            while type(chunk) is not Last:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                try:
                    chunk = await self.body.__anext__()
                except StopAsyncIteration:
                    chunk = Last()
            # the body's last bytes end the response in the same send (one write, not two)
            await send({"type": "http.response.body", "body": chunk, "more_body": False})
        except OSError:
            log.debug("client went away mid-response")


class Last(bytes):
    """A body's final bytes: nothing follows them (see Guarded)."""


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)).encode() + b"\n\n"


_HOLE = "\ue000realizar-text\ue000"     # where a chunk template's text goes (a private-use mark)


class ChunkTemplate:
    """The SSE bytes of one kind of chunk whose only varying field is a text, `make(text)` being
    its dict: encoded once per stream with a mark in the text's place, then each chunk is the
    bytes around the mark with the text JSON-encoded between them. json.dumps encodes a string
    inside a dict exactly as on its own, so the bytes equal sse(make(text)): one string encoding
    per token instead of a dict's (and its nested lists' and dicts')."""
    __slots__ = ("make", "head", "tail")

    def __init__(self, make):
        self.make = make
        parts = sse(make(_HOLE)).split(json.dumps(_HOLE, ensure_ascii=False).encode())
        # the mark elsewhere too (a model named with it): every chunk goes the dict's way
        self.head, self.tail = parts if len(parts) == 2 else (None, None)

    def __call__(self, text: str) -> bytes:
        if self.head is None:
            return sse(self.make(text))
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage object; with `cached`, the prompt tokens the prefix cache held."""
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def finish(reason: str | None) -> str | None:
    # a sequence cut short by the server's shutdown reads as "length" (the output is incomplete);
    # "abort" only reaches a client whose request was cancelled server-side; report it as stop
    return None if reason is None else ("length" if reason in ("length", "shutdown") else "stop")


async def dumps(state: ServerState, obj: dict, size: int) -> bytes:
    def dump() -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()
    return dump() if size < LARGE_JSON_CHARS else await state.offload(dump)


async def stream(engine, plan, head: dict, make_choices) -> AsyncIterator[bytes]:
    """OpenAI's SSE framing, shared by completions and chat: the chunks of each engine output
    (make_choices(i, out) gives their choices, or a template's bytes), then usage and [DONE].
    plan: jobs, prompt_tokens, include_usage, continuous_usage (every chunk carries its choice's
    usage so far: make_choices then gives dicts) and cached_tokens(). An error after the stream
    started can only be reported in-band."""
    tokens_out = [0] * len(plan.jobs)
    cached = [0] * len(plan.jobs)
    sent = False
    left = len(plan.jobs)
    end: list[bytes] = []         # the last choice's final chunks, sent with usage and [DONE]
    try:
        async for i, out in merged(engine, plan.jobs):
            tokens_out[i] = out.completion_tokens
            cached[i] = max(cached[i], out.cached_tokens)
            chunks = make_choices(i, out)
            if type(chunks) is not bytes:       # a template's chunk (the usual one) or choice dicts
                extra = {"usage": usage(len(plan.jobs[i][0]), tokens_out[i])} if plan.continuous_usage else {}
                chunks = b"".join(sse({**head, "choices": [choice], **extra}) for choice in chunks)
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
            raise                 # nothing sent yet: Guarded turns it into an HTTP error status
        if not isinstance(e, (RequestError, CapacityError)):
            log.error("stream failed after it started", exc_info=e)
        end.append(sse(error_body(str(e), getattr(e, "type", "server_error"))))
    if plan.include_usage:
        end.append(sse({**head, "choices": [], "usage": usage(plan.prompt_tokens, sum(tokens_out),
                                                               plan.cached_tokens(cached))}))
    end.append(sse("[DONE]"))
    yield Last(b"".join(end))
