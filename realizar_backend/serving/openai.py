"""OpenAI-compatible HTTP API: response shapes and the route handlers (request bodies are read
and checked in requests.py and turned into engine jobs in plans.py; structured output in
structured.py, tool calls in tools.py, the token routes in tokens.py; what every API's routes
share in handlers.py; app.py puts the routes together).

Paths, status codes and server-sent events are exactly OpenAI's: /v1/models, /v1/completions,
/v1/chat/completions; and vLLM's /tokenize and /detokenize.
Nothing heavy runs on the event loop: tokenizing, chat template renders (themselves in worker
processes) and large JSON go to `ServerState.work`, so /livez and every stream keep flowing
while one request carries megabytes.

Each choice is one engine sequence; the engine batches all of them, across clients. A response
does not start until the first token exists, so every error that can happen before that
(validation, context overflow, a full queue) is a proper HTTP status. A client that goes away
cancels its sequences at once (see `handlers.Guarded`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import CapacityError, RequestError
from . import plans
from . import requests as rq
from .handlers import SSE_HEADERS
from .handlers import Guarded as _Guarded
from .handlers import Last as _Last
from .handlers import dumps as _dumps
from .handlers import merged as _merged
from .plans import Plan
from .requests import error_body
from .state import ServerState
from .tools import ToolStreamParser, delta_chunks, finish_reason, parse_reply

log = logging.getLogger(__name__)


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
        plan = await state.offload(plans.completion_plan, raw, engine, state.settings)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if plan.stream:
            return _Guarded(state, _stream_completion(engine, plan, head), "text/event-stream", SSE_HEADERS)
        return _Guarded(state, _full_completion(state, engine, plan, head), "application/json")

    async def chat(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await state.offload(plans.chat_plan, raw, engine, state.settings)
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

    return [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
    ]


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
