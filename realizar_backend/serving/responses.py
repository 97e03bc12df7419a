"""OpenAI's Responses API: POST /v1/responses (streamed and not), GET and DELETE
/v1/responses/{id}, so that the official client's `client.responses` and agents that speak only
this API (Codex) work unchanged. Request bodies are read in responses_input.py into the chat
every API of this server shares (template, tools, grammar); the reply is split into output items
by replies.py (message, function_call; reasoning where the model reasons), the same split chat
completions make.

Stateless by default, as far as the engine goes: a response is kept (its conversation: the
earlier one it continued, its input and its output) only so that a later request can name it in
`previous_response_id` or GET it. The front end keeps the last REALIZAR_RESPONSES_STORE_SIZE
responses in memory (least recently used out first; 0: none); `store: false` keeps nothing.
A stored response is known only to the server process that made it (not to other replicas).

A streamed response is the Responses API's event sequence, each event with its `type` and a
`sequence_number` from 0: response.created, response.in_progress, then per output item
response.output_item.added, its content (response.content_part.added, response.output_text.delta
..., response.output_text.done, response.content_part.done; or
response.function_call_arguments.delta ... .done; or response.reasoning_text.delta ... .done),
response.output_item.done, and at the end response.completed (or response.incomplete when
max_output_tokens cut it short, response.failed on an error after the stream started). Nothing is
sent until the first token exists, so an error before it is an HTTP status.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import CapacityError, RequestError
from . import requests as rq
from . import responses_input as ri
from .plans import planned
from .streaming import SSE_HEADERS, Guarded, Last, dumps, merged
from .replies import ReplyReader, read_whole
from .state import ServerState

log = logging.getLogger(__name__)


class ResponseStore:
    """The last `size` stored responses, by id: each its conversation items and response object.
    Thread-safe (plans read it on worker threads)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict[str, tuple[list[dict], dict]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None:
                self._entries.move_to_end(rid)
            return entry

    def put(self, rid: str, items: list[dict], response: dict) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._entries[rid] = (items, response)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._entries.pop(rid, None) is not None


def _not_found(rid: str) -> RequestError:
    return RequestError(f"Response with id '{rid}' not found.", status=404, param="response_id",
                        code="response_not_found")


def routes(state: ServerState, endpoint) -> list[Route]:
    """The Responses API's routes over `state` (endpoint: handlers.make_endpoint's wrapper)."""
    store = ResponseStore(state.settings.responses_store_size)

    def previous(rid: str) -> list[dict] | None:
        entry = store.get(rid)
        return None if entry is None else entry[0]

    async def create(request: Request, engine) -> Response:
        raw = await rq.read_body(request, state.settings.max_request_bytes)
        plan = await planned(state, request.receive, ri.responses_plan, raw, engine, state.settings, previous)
        run = _Run(plan, engine.model_name, store)
        if plan.stream:
            return Guarded(state, run.stream(engine), "text/event-stream", SSE_HEADERS)
        return Guarded(state, run.whole(state, engine), "application/json")

    async def get(request: Request, engine) -> Response:
        rid = request.path_params["response_id"]
        entry = store.get(rid)
        if entry is None:
            raise _not_found(rid)
        return JSONResponse(entry[1])

    async def delete(request: Request, engine) -> Response:
        rid = request.path_params["response_id"]
        if not store.delete(rid):
            raise _not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    return [Route("/v1/responses", endpoint(create), methods=["POST"]),
            Route("/v1/responses/{response_id}", endpoint(get), methods=["GET"]),
            Route("/v1/responses/{response_id}", endpoint(delete), methods=["DELETE"])]


def _hex() -> str:
    return uuid.uuid4().hex


class _Run:
    """One response: its output items, built whole or as events, and its storing."""

    def __init__(self, plan: ri.ResponsesPlan, model: str, store: ResponseStore):
        self.plan, self.model, self.store = plan, model, store
        self.id, self.created = "resp_" + _hex(), int(time.time())
        self.output: list[dict] = []

    # -------------------------------------------------------------- items and the response object

    def message_item(self, text: str, status: str = "completed", iid: str | None = None) -> dict:
        return {"id": iid or "msg_" + _hex(), "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(self, call_id: str, name: str, arguments: str, status: str = "completed",
                  iid: str | None = None) -> dict:
        item = {"id": iid or "fc_" + _hex(), "type": "function_call", "status": status, "call_id": call_id,
                "name": name, "arguments": arguments}
        if name in self.plan.namespaced:
            item["namespace"], item["name"] = self.plan.namespaced[name]
        return item

    def reasoning_item(self, text: str, iid: str | None = None) -> dict:
        return {"id": iid or "rs_" + _hex(), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def response(self, status: str, usage: dict | None, error: dict | None = None) -> dict:
        done = status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if done else None, "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": self.output, "usage": usage, **self.plan.echo}

    def usage(self, output_tokens: int, cached: int, tokenizer) -> dict:
        prompt = self.plan.prompt_tokens
        # the thought's tokens, counted again from its text (the reply's tokens are not kept apart)
        thought = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")
        reasoning = min(len(tokenizer.encode(thought, add_special_tokens=False)), output_tokens) if thought else 0
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + output_tokens}

    def finished(self, finish: str | None, usage: dict) -> dict:
        status = "incomplete" if finish in ("length", "shutdown") else "completed"
        body = self.response(status, usage)
        if self.plan.store:
            self.store.put(self.id, self.plan.items + _as_input(self.output), body)
        return body

    # -------------------------------------------------------------- whole

    async def whole(self, state, engine) -> AsyncIterator[bytes]:
        text, finish, out_tokens, cached = "", None, 0, 0
        async for _, out in merged(engine, self.plan.jobs):
            text += out.text
            out_tokens, cached = out.completion_tokens, max(cached, out.cached_tokens)
            finish = out.finish_reason or finish
        for part in read_whole(text, self.plan).parts:
            if part.kind == "text":
                self.output.append(self.message_item(part.text))
            elif part.kind == "reasoning":
                self.output.append(self.reasoning_item(part.text))
            else:
                self.output.append(self.call_item(part.call_id, part.name, part.text))
        if finish in ("length", "shutdown") and self.output:
            self.output[-1]["status"] = "incomplete"
        yield Last(await dumps(state, self.finished(finish, self.usage(out_tokens, cached, engine.tokenizer)),
                             len(text)))

    # -------------------------------------------------------------- streamed

    async def stream(self, engine) -> AsyncIterator[bytes]:
        ev = _Events(self)
        reader = ReplyReader(self.plan)
        started = False
        cached = 0
        try:
            async for _, out in merged(engine, self.plan.jobs):
                chunks: list[bytes] = []
                if not started:
                    started, cached = True, out.cached_tokens
                    chunks.append(ev.emit("response.created", response=self.response("in_progress", None)))
                    chunks.append(ev.emit("response.in_progress", response=self.response("in_progress", None)))
                events = reader.feed(out.text)
                if out.finish_reason is None:
                    chunks += ev.write(events)
                    if chunks:
                        yield b"".join(chunks)
                    continue
                chunks += ev.write(events + reader.finish())
                incomplete = out.finish_reason in ("length", "shutdown")
                chunks += ev.close("incomplete" if incomplete else "completed")
                body = self.finished(out.finish_reason, self.usage(out.completion_tokens, cached, engine.tokenizer))
                chunks.append(ev.emit("response.incomplete" if incomplete else "response.completed", response=body))
                yield Last(b"".join(chunks))
                return
        except Exception as e:
            if not started:
                raise             # nothing sent yet: Guarded answers with the error's status
            if not isinstance(e, (RequestError, CapacityError)):
                log.error("stream failed after it started", exc_info=e)
            code = e.code if isinstance(e, RequestError) else "server_error"
            message = str(e) if isinstance(e, (RequestError, CapacityError)) else "internal error while generating"
            body = self.response("failed", None, {"code": code or "server_error", "message": message})
            yield Last(ev.emit("response.failed", response=body))


def _as_input(output: list[dict]) -> list[dict]:
    """Output items as the input items a later request would send back (reasoning left out)."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "input_text", "text": item["content"][0]["text"]}]})
        elif item["type"] == "function_call":
            call = {k: item[k] for k in ("call_id", "name", "arguments", "namespace") if k in item}
            items.append({"type": "function_call", **call})
    return items


class _Events:
    """A streamed response's events: reply events -> output items opened, filled and closed."""

    def __init__(self, run: _Run):
        self.run = run
        self.seq = 0
        self.open: dict | None = None      # the open item: {kind, id, text}

    def emit(self, kind: str, **fields) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.run.output)}

    def _start(self, kind: str, item: dict, part: dict | None = None, call: tuple = ()) -> list[bytes]:
        out = self.close()
        self.open = {"kind": kind, "id": item["id"], "text": "", "call": call}
        out.append(self.emit("response.output_item.added", output_index=len(self.run.output), item=item))
        if part is not None:
            out.append(self.emit("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def write(self, events: list[tuple]) -> list[bytes]:
        out: list[bytes] = []
        run = self.run
        for e in events:
            kind = e[0]
            opened = self.open["kind"] if self.open is not None else None
            if kind == "text":
                if opened != "text":
                    item = run.message_item("", "in_progress")
                    item["content"] = []
                    out += self._start("text", item, {"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []})
                self.open["text"] += e[1]
                out.append(self.emit("response.output_text.delta", **self._where(), content_index=0, delta=e[1],
                                     logprobs=[]))
            elif kind == "reasoning":
                if opened != "reasoning":
                    item = run.reasoning_item("")
                    item["content"] = []
                    out += self._start("reasoning", item, {"type": "reasoning_text", "text": ""})
                self.open["text"] += e[1]
                out.append(self.emit("response.reasoning_text.delta", **self._where(), content_index=0,
                                     delta=e[1]))
            elif kind == "call":
                out += self._start("call", run.call_item(e[2], e[3], "", "in_progress"), call=(e[2], e[3]))
            else:       # args
                self.open["text"] += e[2]
                out.append(self.emit("response.function_call_arguments.delta", **self._where(), delta=e[2]))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """End the open item (status: that of the response's last item)."""
        o, run = self.open, self.run
        if o is None:
            return []
        where = self._where()
        if o["kind"] == "text":
            item = run.message_item(o["text"], status, o["id"])
            out = [self.emit("response.output_text.done", **where, content_index=0, text=o["text"], logprobs=[]),
                   self.emit("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        elif o["kind"] == "reasoning":
            item = run.reasoning_item(o["text"], o["id"])
            out = [self.emit("response.reasoning_text.done", **where, content_index=0, text=o["text"]),
                   self.emit("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            item = run.call_item(*o["call"], o["text"], status, o["id"])
            out = [self.emit("response.function_call_arguments.done", **where, arguments=o["text"])]
        out.append(self.emit("response.output_item.done", output_index=where["output_index"], item=item))
        run.output.append(item)
        self.open = None
        return out
