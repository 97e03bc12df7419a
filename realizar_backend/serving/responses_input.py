"""OpenAI Responses request bodies -> engine jobs (the routes are responses.py's). A request is
read into the chat every API of this server shares (plans.chat_jobs): messages as the chat
template takes them, function tools, and a constraint for structured output.

- `input`: a string (one user message) or items: messages (`role` user, system, developer or
  assistant; content a string or `input_text` / `output_text` parts), `function_call` (an
  assistant's call: `call_id`, `name`, `arguments` as JSON text), `function_call_output` (the
  tool message answering that call_id), and `reasoning` (earlier reasoning: not shown to the
  model).
- `reasoning.effort`: given to the chat template as `reasoning_effort` (templates that read it). Image, file and audio parts and other item types are a 400.
- `instructions`: a system message before everything else (not carried to a later response
  that names this one in `previous_response_id`, as OpenAI does).
- `tools`: function tools in the flat shape (`{"type": "function", "name", "description",
  "parameters", "strict"}`), and namespaces of them (`{"type": "namespace", "name", "tools"}`:
  the model sees `namespace.name`, a call comes back with `namespace` and `name` apart). Hosted
  tools (web search, file search, code interpreter, image generation, computer use, MCP) run on
  OpenAI's side: accepted and not offered to the model, as nothing here runs them.
- `tool_choice`: auto | none | required | {"type": "function", "name"}; `parallel_tool_calls`.
- `text.format`: text | json_object | json_schema {name, schema, strict} (structured output).
- `max_output_tokens`: an upper bound, cut to the room the context leaves after the prompt.
- `previous_response_id`: the conversation of a stored response (responses.py's store) goes
  before `input`; an id that is not stored (never, not with `store: true`, or dropped since) is a
  404.

Fields that cannot change this server's output (`metadata`, `user`, `include`,
`reasoning.summary`, `prompt_cache_key`, `service_tier`, `truncation`, ...) are accepted and ignored;
features it lacks (`background`, `conversation`, `prompt`, `top_logprobs`) are a 400 unless
neutral; unknown fields are a 400 naming the field, as on every OpenAI route.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine.guidance import Constraint
from ..engine.sampling import SamplingParams
from ..errors import RequestError
from . import requests as rq
from .chat_request import REASONING_EFFORTS, chat_options
from .plans import chat_jobs, request_tokens
from .reasoning import ReasoningFormat
from .requests import bad
from .tools import MAX_TOOLS, ToolRequest, ToolStreamParser, tool_request

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature",
          "top_p", "stream", "store", "previous_response_id", "reasoning", "parallel_tool_calls", "metadata", "user",
          "include", "truncation", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
          "client_metadata", "max_tool_calls", "stream_options", "background", "conversation", "prompt",
          "top_logprobs"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# tools that OpenAI runs on its side: nothing here runs them, so the model is not offered them
_HOSTED = re.compile(r"^(web_search\w*|file_search|code_interpreter|image_generation|computer_use\w*|mcp)$")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
NS = "."                 # joins a namespace and its function's name into the name the model sees


@dataclass
class ResponsesPlan:
    jobs: list
    prompt_tokens: int
    stream: bool
    store: bool
    tools: ToolRequest | None
    items: list[dict]            # the conversation so far (the previous response's, then input) to store
    echo: dict                   # the request's fields a response object repeats
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)   # model's name -> (namespace, name)
    reasoning: ReasoningFormat | None = None    # the model thinks in this format
    thinking_inside: bool = False               # the prompt left the model inside a thought

    @property
    def calls_tools(self) -> bool:
        return self.tools is not None and ToolStreamParser(self.tools).active


def responses_plan(raw: bytes, engine, settings, previous: Callable[[str], list[dict] | None],
                   cancel: threading.Event | None = None) -> ResponsesPlan:
    """POST /v1/responses as one engine job. previous(id): a stored response's conversation
    items, or None. Blocking (tokenizing, the template, the grammar): call it on a worker thread."""
    body = rq.parse_json(raw)
    body.only(FIELDS)
    rq.check_model(body, engine)
    if not getattr(engine.tokenizer, "has_chat_template", True):
        raise bad("input", "this model has no chat template")
    for name in ("background", "conversation", "prompt", "top_logprobs"):
        body.unsupported(name)
    for name, kind in (("metadata", "dict"), ("reasoning", "dict"), ("include", "list"), ("user", "str"),
                       ("stream_options", "dict"), ("client_metadata", "dict"), ("truncation", "str")):
        body.get(name, kind)
    instructions = body.get("instructions", "str")
    prev_id = body.get("previous_response_id", "str")
    items: list[dict] = []
    if prev_id is not None:
        stored = previous(prev_id)
        if stored is None:
            raise RequestError(f"Previous response with id '{prev_id}' not found.", status=404,
                               param="previous_response_id", code="previous_response_not_found")
        items = list(stored)
    items += input_items(body.data.get("input"))
    tools, namespaced, rendered = _tools(body.get("tools", "list"), body.data.get("tool_choice"),
                                         body.get("parallel_tool_calls", "bool", True), engine.tokenizer.chat_template)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + to_messages(items)
    max_tokens = body.get("max_output_tokens", "int")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_output_tokens", f"max_output_tokens: must be at least 1, got {max_tokens}")
    params = SamplingParams(max_tokens=max_tokens, temperature=body.get("temperature", "number", 1.0),
                            top_p=body.get("top_p", "number", 1.0))
    fmt, constraint = _text_format(body.get("text", "dict"))
    # reasoning.effort goes to the template as chat's reasoning_effort does (templates that read it)
    effort = (body.data.get("reasoning") or {}).get("effort")
    options = chat_options({"reasoning_effort": effort} if effort in REASONING_EFFORTS else {}, engine.tokenizer)
    jobs, prompt_tokens = chat_jobs(engine, params, messages, tools, constraint, cap_to_context=True,
                                    options=options, limit=request_tokens(engine, settings), cancel=cancel)
    thinking = jobs[0][1].thinking          # prepare saw the prompt: is the model inside a thought?
    store = body.get("store", "bool", True)
    choice = body.data.get("tool_choice") or "auto"
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "parallel_tool_calls":
            body.get("parallel_tool_calls", "bool", True), "previous_response_id": prev_id,
            "temperature": params.temperature, "top_p": params.top_p, "text": {"format": fmt},
            "tool_choice": choice, "tools": rendered, "metadata": body.data.get("metadata") or {},
            "user": body.data.get("user"), "store": store,
            "truncation": body.data.get("truncation") or "disabled",
            "reasoning": {"effort": (body.data.get("reasoning") or {}).get("effort"), "summary": None}}
    return ResponsesPlan(jobs, prompt_tokens, body.get("stream", "bool", False), store, tools, items, echo, namespaced,
                         options.reasoning, thinking is not None and thinking.inside)


def input_items(value: Any) -> list[dict]:
    """`input` as checked items (a string: one user message); reasoning items are left out, as
    the model is not shown them."""
    if value is None:
        raise bad("input", "input: this field is required", "missing_required_parameter")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad("input", "input: expected a string or an array of items", "invalid_type")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where}: expected an object", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad(f"{where}.role", f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}")
            out.append({"type": "message", "role": role,
                        "content": [{"type": "input_text", "text": _text(item.get("content"), f"{where}.content")}]})
        elif kind == "function_call":
            call = {k: _string(item, k, where) for k in ("call_id", "name", "arguments")}
            try:
                ok = isinstance(json.loads(call["arguments"]), dict)
            except ValueError:
                ok = False
            if not ok:
                raise bad(f"{where}.arguments", f"{where}.arguments: expected a JSON object, as a string")
            if item.get("namespace") is not None:
                call["namespace"] = _string(item, "namespace", where)
            out.append({"type": "function_call", **call})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "call_id": _string(item, "call_id", where),
                        "output": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise bad(f"{where}.type", f"{where}.type: input items of type {kind!r} are not supported by this server")
    return out


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (not v and key != "arguments"):
        raise bad(f"{where}.{key}", f"{where}.{key}: expected a non-empty string", "invalid_type")
    return v


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"{where}: expected a string or an array of content parts", "invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            what = "this server's model reads text only" if kind in ("input_image", "input_file", "input_audio") \
                else "expected input_text or output_text parts"
            raise bad(f"{where}[{j}]", f"{where}[{j}]: {kind!r} parts are not supported: {what}")
        parts.append(part["text"])
    return "".join(parts)


def to_messages(items: list[dict]) -> list[dict]:
    """Checked items -> the chat template's messages: consecutive function calls join the
    assistant message before them, each output is a tool message (answering an earlier call)."""
    out: list[dict] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            out.append({"role": _ROLES[item["role"]], "content": item["content"][0]["text"]})
        elif kind == "function_call":
            name = item["name"] if "namespace" not in item else item["namespace"] + NS + item["name"]
            call = {"id": item["call_id"], "type": "function", "function": {"name": name,
                                                                            "arguments": item["arguments"]}}
            calls.add(item["call_id"])
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            if item["call_id"] not in calls:
                raise bad(f"input[{i}].call_id", f"input[{i}].call_id: no earlier function_call has the call_id "
                                                 f"{item['call_id']!r}")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not out:
        raise bad("input", "input: no messages to answer")
    return out


def _tools(tools: list | None, choice: Any, parallel: bool, chat_template: str | None):
    """(ToolRequest or None, the model's name of each namespaced function -> (namespace, name),
    the tools as a response object repeats them)."""
    defined: list[tuple[str, str | None, dict]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    rendered: list[dict] = []

    def function(t: dict, where: str, namespace: str | None) -> None:
        name, desc, params = t.get("name"), t.get("description"), t.get("parameters")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{where}.name", f"{where}.name: must be 1-64 letters, digits, underscores or dashes")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{where}.description", f"{where}.description: expected a string", "invalid_type")
        if params is None:
            params = {"type": "object", "properties": {}}
        elif not isinstance(params, dict):
            raise bad(f"{where}.parameters", f"{where}.parameters: expected a JSON schema object", "invalid_type")
        full = name if namespace is None else namespace + NS + name
        if any(d[0] == full for d in defined):
            raise bad(f"{where}.name", f"{where}.name: two tools are named {full!r}")
        if namespace is not None:
            namespaced[full] = (namespace, name)
        defined.append((full, desc, params))

    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(where, f"{where}: expected an object", "invalid_type")
        kind = t.get("type")
        if kind == "function":
            function(t, where, None)
        elif kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not _NAME.match(ns):
                raise bad(f"{where}.name", f"{where}.name: must be 1-64 letters, digits, underscores or dashes")
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise bad(f"{where}.tools", f"{where}.tools: expected an array of function tools", "invalid_type")
            for j, ft in enumerate(inner):
                if not isinstance(ft, dict) or ft.get("type") != "function":
                    raise bad(f"{where}.tools[{j}]", f"{where}.tools[{j}]: only function tools may be in a namespace")
                function(ft, f"{where}.tools[{j}]", ns)
        elif isinstance(kind, str) and _HOSTED.match(kind):
            continue
        else:
            raise bad(f"{where}.type", f"{where}.type: tools of type {kind!r} are not supported by this server "
                                       f"(function tools are)")
        rendered.append(t)
    if len(defined) > MAX_TOOLS:
        raise bad("tools", f"tools: at most {MAX_TOOLS} functions, got {len(defined)}")
    named = None
    if choice is None or choice in ("auto", "none", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        named = choice.get("name")
        if choice.get("namespace") is not None and isinstance(named, str):
            named = f"{choice['namespace']}{NS}{named}"
        if not any(d[0] == named for d in defined):
            raise bad("tool_choice", f"tool_choice: no function tool is named {named!r}")
        mode = "function"
    else:
        raise bad("tool_choice", 'tool_choice: expected "auto", "none", "required" or {"type": "function", "name"}')
    if not defined:
        if mode in ("required", "function"):
            raise bad("tool_choice", "tool_choice: forces a function call, but no function tools are given")
        return None, namespaced, rendered
    return tool_request(defined, mode, named, parallel, chat_template), namespaced, rendered


def _text_format(text: dict | None) -> tuple[dict, Constraint | None]:
    """(text.format as a response repeats it, the constraint it asks for)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict):
        raise bad("text.format", "text.format: expected an object", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, Constraint("json_object", param="text.format")
    if kind != "json_schema":
        raise bad("text.format.type", f"text.format.type: must be text, json_object or json_schema, got {kind!r}")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad("text.format.name", "text.format.name: must be 1-64 letters, digits, underscores or dashes")
    if not isinstance(schema, dict):
        raise bad("text.format.schema", "text.format.schema: expected a JSON schema object", "invalid_type")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise bad("text.format.strict", "text.format.strict: expected a boolean", "invalid_type")
    # the output always follows the schema; strict (OpenAI's subset) changes nothing here
    return fmt, Constraint("json_schema", schema, param="text.format")
