"""Anthropic's Messages API: POST /v1/messages (streamed and not) and /v1/messages/count_tokens,
so that Anthropic's clients (its SDKs, Claude Code) work unchanged. Request bodies are read in
anthropic_input.py into the chat every API of this server shares (template, tools, grammar); the
reply is split into content blocks by replies.py (text, tool_use; thinking where the model
reasons), the same split chat completions make.

The API key comes as `x-api-key` or `Authorization: Bearer` (handlers.py); `anthropic-version`
and `anthropic-beta` headers are accepted, whatever they say. Errors come in Anthropic's shape,
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, with the status
Anthropic gives each type (streaming.error_json).

A streamed reply is Anthropic's event sequence: message_start, a ping, then per content block
content_block_start, content_block_delta (text_delta, input_json_delta or thinking_delta) and
content_block_stop, then message_delta (stop_reason, stop_sequence, usage) and message_stop. As
on the other routes, nothing is sent until the first token exists, so an error before it is an
HTTP status; one after it is an `error` event that ends the stream.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import CapacityError, RequestError
from . import anthropic_input as ai
from . import requests as rq
from .plans import planned
from .streaming import SSE_HEADERS, Guarded, Last, anthropic_error_body, dumps, merged
from .replies import ReplyReader, read_whole
from .state import ServerState

log = logging.getLogger(__name__)


def routes(state: ServerState, endpoint) -> list[Route]:
    """Anthropic's routes over `state` (endpoint: handlers.make_endpoint's wrapper)."""

    async def messages(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await planned(state, request.receive, ai.messages_plan, raw, engine, state.settings)
        head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": engine.model_name}
        if plan.stream:
            return Guarded(state, _stream(plan, engine, head), "text/event-stream", SSE_HEADERS)
        return Guarded(state, _whole(state, plan, engine, head), "application/json")

    async def count_tokens(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        return JSONResponse(await state.offload(ai.count_tokens, raw, engine))

    return [Route("/v1/messages", endpoint(messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", endpoint(count_tokens), methods=["POST"])]


def _tool_use_id(call_id: str) -> str:
    # Anthropic's ids read toolu_...; the parser's call_... ids carry the same random part
    return "toolu_" + call_id.removeprefix("call_")


def _stop_reason(finish: str | None, stop_string: str | None, calls: int) -> str:
    if finish in ("length", "shutdown"):
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def _usage(prompt: int, output: int, cached: int) -> dict:
    # Anthropic counts the prompt tokens read from the cache apart from input_tokens
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached}


async def _whole(state, plan: ai.MessagesPlan, engine, head: dict) -> AsyncIterator[bytes]:
    text, finish, out_tokens, cached, stop_string = "", None, 0, 0, None
    async for _, out in merged(engine, plan.jobs):
        text += out.text
        out_tokens, cached = out.completion_tokens, max(cached, out.cached_tokens)
        if out.finish_reason is not None:
            finish, stop_string = out.finish_reason, out.stop_string
    reply = read_whole(text, plan)
    content = []
    for part in reply.parts:
        if part.kind == "text":
            content.append({"type": "text", "text": part.text})
        elif part.kind == "reasoning":
            content.append({"type": "thinking", "thinking": part.text, "signature": ""})
        else:
            try:
                args = json.loads(part.text or "{}")
            except ValueError:       # a call cut short by max_tokens: its arguments never closed
                args = {}
            content.append({"type": "tool_use", "id": _tool_use_id(part.call_id), "name": part.name, "input": args})
    stop_reason = _stop_reason(finish, stop_string, len(reply.calls))
    body = {**head, "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_string if stop_reason == "stop_sequence" else None,
            "usage": _usage(plan.prompt_tokens, out_tokens, cached)}
    yield Last(await dumps(state, body, len(text)))


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed reply: opens a block when the kind of event changes,
    closes the one before."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))
        return out

    def _delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def write(self, events: list[tuple]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            kind = ev[0]
            if kind == "text":
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": ev[1]}))
            elif kind == "reasoning":
                if self.open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": ev[1]}))
            elif kind == "call":
                out += self._start("tool_use", {"type": "tool_use", "id": _tool_use_id(ev[2]), "name": ev[3],
                                                "input": {}})
            else:   # args
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev[2]}))
        return out


async def _stream(plan: ai.MessagesPlan, engine, head: dict) -> AsyncIterator[bytes]:
    reader = ReplyReader(plan)
    blocks = _Blocks()
    started = False
    try:
        async for _, out in merged(engine, plan.jobs):
            chunks: list[bytes] = []
            if not started:
                started = True
                usage = _usage(plan.prompt_tokens, out.completion_tokens, out.cached_tokens)
                chunks.append(_event("message_start", {"type": "message_start", "message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}))
                chunks.append(_event("ping", {"type": "ping"}))
                cached = out.cached_tokens
            events = reader.feed(out.text)
            if out.finish_reason is None:
                chunks += blocks.write(events)
                if chunks:
                    yield b"".join(chunks)
                continue
            chunks += blocks.write(events + reader.finish())
            chunks += blocks.close()
            stop_reason = _stop_reason(out.finish_reason, out.stop_string, reader.calls)
            chunks.append(_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason,
                          "stop_sequence": out.stop_string if stop_reason == "stop_sequence" else None},
                "usage": _usage(plan.prompt_tokens, out.completion_tokens, cached)}))
            chunks.append(_event("message_stop", {"type": "message_stop"}))
            yield Last(b"".join(chunks))
            return
    except Exception as e:
        if not started:
            raise                 # nothing sent yet: Guarded answers with the error's status
        if not isinstance(e, (RequestError, CapacityError)):
            log.error("stream failed after it started", exc_info=e)
        status = e.status if isinstance(e, RequestError) else 503 if isinstance(e, CapacityError) else 500
        yield Last(_event("error", anthropic_error_body(status, str(e) if status != 500 else
                                                        "internal error while generating")))
