"""What every API's routes share (OpenAI's in openai.py and responses.py, Anthropic's in
anthropic.py): the API key, the engine's readiness, errors in the shape of the API a path
belongs to, running a request's engine jobs, and responses that send nothing until their first
bytes exist (so that every error before the first token is a proper HTTP status).

Errors: OpenAI's shape `{"error": {"message", "type", "param", "code"}}` everywhere but under
/v1/messages, which answers in Anthropic's, `{"type": "error", "error": {"type", "message"}}`,
with the error type that Anthropic gives the same status.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import uuid
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.sampling import SamplingParams
from ..errors import CapacityError, RequestError
from . import requests as rq
from .requests import error_body
from .state import ServerState

log = logging.getLogger(__name__)

LARGE_JSON_CHARS = 256 << 10      # a response body this large is serialised off the event loop
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ANTHROPIC_PATHS = "/v1/messages"   # the routes that speak Anthropic's API (and its error shape)

# Anthropic's error type for each status it uses (anything else: api_error)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_json(path: str, status: int, message: str, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    """An error response in the shape of the API that `path` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(state: ServerState, exc: BaseException, path: str) -> JSONResponse:
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


class NotReady(Exception):
    pass


# ------------------------------------------------------------------------------ route wrappers

def api_key_of(request: Request) -> str:
    """The key a request carries: `Authorization: Bearer <key>` (OpenAI's clients, Anthropic's
    with an auth token) or `x-api-key: <key>` (Anthropic's clients)."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key", "").strip()


def make_endpoint(state: ServerState):
    """endpoint(fn): a Starlette handler that checks the API key and the engine's readiness and
    calls fn(request, engine); typed errors keep their status, anything else is a logged 500,
    each in the shape of the route's API."""

    def authorize(request: Request) -> None:
        key = state.settings.api_key
        if not key:
            return
        given = api_key_of(request)
        if not given or not hmac.compare_digest(given.encode(), key.encode()):
            raise RequestError("missing or incorrect API key; send `Authorization: Bearer <key>` or "
                               "`x-api-key: <key>`", status=401, code="invalid_api_key")

    def ready_engine():
        if state.engine is None:
            msg = "the model is still loading" if state.load_error is None else \
                f"this worker cannot serve the model: {state.load_error}"
            raise NotReady(msg)
        return state.engine

    def endpoint(fn):
        async def handler(request: Request):
            path = request.url.path
            try:
                authorize(request)
                return await fn(request, ready_engine())
            except NotReady as e:
                if state.metrics is not None:
                    state.metrics.on_http_error(503)
                # a new connection may reach another worker that is ready (serving/service.py)
                return error_json(path, 503, str(e), "server_error", None, "model_not_ready",
                                  headers={"Retry-After": "5", "Connection": "close"})
            except rq.ClientGone:
                log.info("%s %s: the client left while sending its request body", request.method, path)
                return client_closed_response()
            except Exception as e:       # typed errors keep their status; anything else is a logged 500
                return error_response(state, e, path)
        return handler

    return endpoint


def client_closed_response() -> Response:
    # nobody reads it; BentoML's middlewares wait for a response to close the request.
    # 499 is nginx's "client closed request".
    return JSONResponse(error_body("client closed the request", code="client_closed_request"), status_code=499)


async def dumps(state: ServerState, obj: dict, size: int) -> bytes:
    """obj as JSON bytes; serialised on a worker thread when `size` (its text) is large."""
    def dump() -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()
    return dump() if size < LARGE_JSON_CHARS else await state.offload(dump)


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


class InFlight:
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
            response = error_json(scope["path"], 503, "the server is shutting down; retry on another replica",
                                  "server_error", None, "server_shutting_down",
                                  headers={"Retry-After": "5", "Connection": "close"})
            return await response(scope, receive, send)
        self.state.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.active -= 1
