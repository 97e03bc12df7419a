"""The HTTP app: every API's routes in one plain Starlette app (BentoML mounts it with
`bentoml.asgi_app`), so paths, status codes and server-sent events are exactly each API's own:
OpenAI's (openai.py: models, completions, chat completions, vLLM's token routes; responses.py:
the Responses API) and Anthropic's (anthropic.py: messages)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import anthropic, openai, responses
from .handlers import InFlight, make_endpoint
from .streaming import error_json
from .state import ServerState

# /v1 routes and their one method, for the 405 of a wrong one (a /v1/models/... or
# /v1/responses/... path takes GET)
_KNOWN = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST",
          "/v1/responses": "POST", "/v1/messages": "POST", "/v1/messages/count_tokens": "POST"}
_GET_UNDER = ("/v1/models/", "/v1/responses/")


def create_app(state: ServerState):
    """Every API's routes over `state`; the service mounts this at /."""
    endpoint = make_endpoint(state)
    routes = [*openai.routes(state, endpoint), *responses.routes(state, endpoint),
              *anthropic.routes(state, endpoint)]

    async def fallback(request: Request) -> Response:
        # BentoML answers unmatched paths itself (plain text); catching /v1/* here keeps the
        # API's error shape for unknown routes and wrong methods
        path = request.url.path.rstrip("/")
        if path in _KNOWN or path.startswith(_GET_UNDER):
            raise HTTPException(405, f"method not allowed (use {_KNOWN.get(path, 'GET')})")
        raise HTTPException(404, "no such route")

    routes.append(Route("/v1/{rest:path}", fallback,
                        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # unknown paths and wrong methods keep the API's error shape too
        if state.metrics is not None:
            state.metrics.on_http_error(exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_json(request.url.path, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          code=code, headers=exc.headers)

    return InFlight(Starlette(routes=routes, exception_handlers={HTTPException: http_error}), state)
