"""What every API's routes share besides answering (streaming.py has that): the API key, the
engine's readiness and the requests in flight, with errors in the shape of the API a path
belongs to (streaming.error_json): OpenAI's everywhere but under /v1/messages, which answers in
Anthropic's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from starlette.requests import Request

from ..errors import RequestError
from . import requests as rq
from .state import ServerState
from .streaming import client_closed_response, error_json, error_response

log = logging.getLogger(__name__)


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
            except rq.ClientGone as e:
                log.info("%s %s: %s", request.method, path, e)
                return client_closed_response()
            except Exception as e:       # typed errors keep their status; anything else is a logged 500
                return error_response(state, e, path)
        return handler

    return endpoint


class InFlight:
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
            response = error_json(scope["path"], 503, "the server is shutting down; retry on another replica",
                                  "server_error", None, "server_shutting_down",
                                  headers={"Retry-After": "5", "Connection": "close"})
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
        response = error_json(scope["path"], 504, f"the request did not complete within {limit:g} s (this "
                                                  f"server's REALIZAR_REQUEST_TIMEOUT_S)", "server_error", None,
                              "response_timeout")        # (408's request_timeout: the client was slow)
        await response(scope, receive, send)
