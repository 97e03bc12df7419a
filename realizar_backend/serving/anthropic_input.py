"""Anthropic Messages request bodies -> engine jobs (the routes are anthropic.py's). A request is
read into the shape every chat of this server takes (plans.chat_jobs): messages as the chat
template takes them (role, text content, an assistant's tool_calls, a tool message's
tool_call_id), the function tools, and a constraint for structured output; so the model's own
template, tool-call grammar and parser serve Anthropic's API exactly as they serve OpenAI's.

- `system` (a string or text blocks) is the first system message; a `system` message inside
  `messages` stays where it is.
- content blocks: `text`; an assistant's `tool_use` (a call: its `input` becomes the arguments'
  JSON text) and `thinking` / `redacted_thinking` (earlier reasoning: not shown to the model,
  as Anthropic's API drops it too); a user's `tool_result` (a tool message answering the
  `tool_use` of that id, text or text blocks; `is_error` prefixes "Error: "). Image, document
  and other block types are a 400: this server's models read text only.
- tools: custom tools (`name`, `description`, `input_schema`). Anthropic's server tools (web
  search, web fetch, code execution) run on Anthropic's side: accepted and not offered to the
  model, since this server runs none. Schema-less client tools (bash, text editor, computer,
  memory) are a 400: their schemas are Anthropic's, not in the request.
- `tool_choice`: auto | any (calls only) | tool (that tool, once) | none (tools not shown);
  `disable_parallel_tool_use`: one call at most.
- `max_tokens` is required, as Anthropic requires it; it is an upper bound, so one larger than
  the room the context leaves after the prompt is cut to that room.
- structured output: `output_config.format` (or the beta's `output_format`), a JSON schema.

- `thinking`: a model whose template thinks is asked not to (Qwen3's `enable_thinking: false`)
  unless thinking is `enabled`, `adaptive` or `between_tools`, as Anthropic's models think only
  when asked; its thought comes back as thinking blocks, and `budget_tokens` bounds it.

Every field the API defines is known: those that cannot change this server's output
(`metadata`, `service_tier`, `context_management`, `output_config.effort`, `cache_control`,
`speed`, `inference_geo`, `diagnostics`, `user_profile_id`, `workspace_id`) are accepted and
ignored; others are a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from ..engine.guidance import Constraint
from ..engine.sampling import SamplingParams
from ..errors import RequestError
from . import requests as rq
from .chat_request import ChatOptions, chat_options
from .plans import chat_jobs, request_tokens
from .reasoning import HARMONY, ReasoningFormat, detect_reasoning
from .tools import MAX_TOOLS, ToolRequest, ToolStreamParser, tool_request

_COMMON = {"model", "messages", "system", "tools", "tool_choice", "thinking", "context_management", "mcp_servers",
           "output_config", "output_format", "cache_control", "speed", "user_profile_id", "workspace_id"}
MESSAGES_FIELDS = _COMMON | {"max_tokens", "metadata", "stop_sequences", "stream", "temperature", "top_p", "top_k",
                             "service_tier", "container", "inference_geo", "diagnostics"}
COUNT_FIELDS = _COMMON
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# tools that Anthropic runs on its side (search, fetch, code execution): nothing here runs them
_SERVER_TOOLS = re.compile(r"^(web_search|web_fetch|code_execution|tool_search_tool_\w+)_\d{8}$")
_ROLES = ("user", "assistant", "system")
_THINKING = ("enabled", "disabled", "adaptive", "between_tools")


def bad(where: str, message: str, status: int = 400) -> RequestError:
    return RequestError(f"{where}: {message}", status=status, param=where)


@dataclass
class Conversation:
    """A request's chat, ready for the template and the grammar."""
    messages: list[dict]
    tools: ToolRequest | None
    constraint: Constraint | None
    options: ChatOptions            # the template's kwargs and the model's thought


@dataclass
class MessagesPlan:
    jobs: list
    prompt_tokens: int
    stream: bool
    tools: ToolRequest | None
    reasoning: ReasoningFormat | None = None    # the model thinks in this format
    thinking_inside: bool = False               # the prompt left the model inside a thought

    @property
    def calls_tools(self) -> bool:
        return self.tools is not None and ToolStreamParser(self.tools).active


def messages_plan(raw: bytes, engine, settings, cancel: threading.Event | None = None) -> MessagesPlan:
    """POST /v1/messages: the checked request as one engine job. Blocking (tokenizing, the
    template, the grammar): call it on a worker thread."""
    body = rq.parse_json(raw)
    body.only(MESSAGES_FIELDS)
    conv = _conversation(body, engine)
    max_tokens = body.require("max_tokens", "int")
    if max_tokens < 1:
        raise bad("max_tokens", f"must be at least 1, got {max_tokens}")
    stop = body.get("stop_sequences", "list", [])
    for s in stop:
        if not isinstance(s, str) or not s:
            raise bad("stop_sequences", "expected non-empty strings")
        if len(s) > settings.max_stop_chars:
            raise bad("stop_sequences", f"each stop sequence may have at most {settings.max_stop_chars} characters")
    body.unsupported("container")
    params = SamplingParams(max_tokens=max_tokens, temperature=body.get("temperature", "number", 1.0),
                            top_p=body.get("top_p", "number", 1.0), top_k=body.get("top_k", "int", 0), stop=stop)
    jobs, prompt_tokens = chat_jobs(engine, params, conv.messages, conv.tools, conv.constraint, cap_to_context=True,
                                    options=conv.options, limit=request_tokens(engine, settings), cancel=cancel)
    thinking = jobs[0][1].thinking          # prepare saw the prompt: is the model inside a thought?
    return MessagesPlan(jobs, prompt_tokens, body.get("stream", "bool", False), conv.tools, conv.options.reasoning,
                        thinking is not None and thinking.inside)


def count_tokens(raw: bytes, engine) -> dict:
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render them."""
    body = rq.parse_json(raw)
    body.only(COUNT_FIELDS)
    conv = _conversation(body, engine)
    tok = engine.tokenizer
    kwargs = dict(conv.options.template_kwargs)
    if conv.tools is not None and conv.tools.template_tools:
        kwargs["tools"] = conv.tools.template_tools
    text = tok.apply_chat_template(conv.messages, add_generation_prompt=True, **kwargs)
    return {"input_tokens": len(tok.encode(text, add_special_tokens=False))}


def _conversation(body: rq.Body, engine) -> Conversation:
    model = body.require("model", "str")
    if model != engine.model_name:
        raise bad("model", f"{model} (this server serves {engine.model_name!r})", status=404)
    if not getattr(engine.tokenizer, "has_chat_template", True):
        raise bad("messages", "this model has no chat template")
    body.unsupported("mcp_servers")
    options = _thinking(body.get("thinking", "dict"), engine.tokenizer)
    tools = _tools(body.get("tools", "list"), body.get("tool_choice", "dict"), engine.tokenizer.chat_template)
    messages = _system(body.data.get("system")) + _messages(body.require("messages", "list"))
    return Conversation(messages, tools, _output_format(body), options)


def _thinking(value: dict | None, tokenizer) -> ChatOptions:
    """`thinking` as the template's and the engine's options: a model whose template thinks is
    asked not to (Qwen3's `enable_thinking: false`) unless thinking is on, as Anthropic's models
    think only when asked; `budget_tokens` is the most tokens its thought may take."""
    kind = "disabled" if value is None else value.get("type")
    if kind not in _THINKING:
        raise bad("thinking.type", f"must be one of {', '.join(_THINKING)}, got {kind!r}")
    budget = (value or {}).get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise bad("thinking.budget_tokens", "expected a positive integer")
    data: dict[str, Any] = {}
    if kind == "disabled":
        data["chat_template_kwargs"] = {"enable_thinking": False}
    elif budget is not None and detect_reasoning(tokenizer.chat_template) not in (None, HARMONY):
        data["max_reasoning_tokens"] = budget
    return chat_options(data, tokenizer)


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (other block types are a 400)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(where, "expected a string or an array of content blocks")
    parts = []
    for i, b in enumerate(blocks):
        parts.append(_text_block(b, f"{where}.{i}"))
    return "\n".join(parts) if where == "system" else "".join(parts)


def _text_block(b: Any, where: str) -> str:
    if not isinstance(b, dict):
        raise bad(where, "expected a content block object")
    if b.get("type") != "text":
        _unsupported_block(b, where)
    if not isinstance(b.get("text"), str):
        raise bad(f"{where}.text", "expected a string")
    return b["text"]


def _unsupported_block(b: dict, where: str) -> None:
    kind = b.get("type")
    if kind in ("image", "document"):
        raise bad(f"{where}.type", f"{kind} blocks are not supported: this server's model reads text only")
    raise bad(f"{where}.type", f"content blocks of type {kind!r} are not supported here")


def _system(value: Any) -> list[dict]:
    if value is None:
        return []
    text = _text_of(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(msgs: list) -> list[dict]:
    if not msgs:
        raise bad("messages", "must contain at least one message")
    out: list[dict] = []
    call_ids: set[str] = set()
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(where, "expected an object")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad(f"{where}.content", "expected a string or an array of content blocks")
        elif role == "assistant":
            out.append(_assistant(content, f"{where}.content", call_ids))
        elif role == "user":
            out.extend(_user(content, f"{where}.content", call_ids))
        else:
            out.append({"role": role, "content": _text_of(content, f"{where}.content")})
    if out[-1]["role"] == "assistant":
        # a prefilled answer: the model would have to continue a turn its template closes
        raise bad(f"messages.{len(msgs) - 1}.role", "a final assistant message (a prefilled answer) is not "
                                                    "supported by this server; end with a user message")
    return out


def _assistant(blocks: list, where: str, call_ids: set[str]) -> dict:
    text, calls = [], []
    for j, b in enumerate(blocks):
        bw = f"{where}.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in ("thinking", "redacted_thinking"):
            continue
        if kind != "tool_use":
            text.append(_text_block(b, bw))
            continue
        cid, name, args = b.get("id"), b.get("name"), b.get("input", {})
        if not isinstance(cid, str) or not cid:
            raise bad(f"{bw}.id", "expected a non-empty string")
        if not isinstance(name, str) or not name:
            raise bad(f"{bw}.name", "expected a non-empty string")
        if not isinstance(args, dict):
            raise bad(f"{bw}.input", "expected an object")
        call_ids.add(cid)
        calls.append({"id": cid, "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list, where: str, call_ids: set[str]) -> list[dict]:
    """A user turn: its tool results (tool messages) and text, in their order."""
    out: list[dict] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        bw = f"{where}.{j}"
        if not (isinstance(b, dict) and b.get("type") == "tool_result"):
            text.append(_text_block(b, bw))
            continue
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        tid = b.get("tool_use_id")
        if not isinstance(tid, str) or tid not in call_ids:
            raise bad(f"{bw}.tool_use_id", f"no earlier tool_use block has the id {tid!r}")
        result = b.get("content", "")
        result = _text_of(result, f"{bw}.content") if result is not None else ""
        if b.get("is_error") is True:
            result = "Error: " + result
        out.append({"role": "tool", "tool_call_id": tid, "content": result})
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(tools: list | None, choice: dict | None, chat_template: str | None) -> ToolRequest | None:
    defined: list[tuple[str, str | None, dict]] = []
    for i, t in enumerate(tools or []):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad(where, "expected an object")
        kind = t.get("type")
        if kind is not None and kind != "custom":
            if isinstance(kind, str) and _SERVER_TOOLS.match(kind):
                continue                     # run by Anthropic's servers: not offered here
            raise bad(f"{where}.type", f"tools of type {kind!r} are not supported; define the tool with a "
                                       f"name, a description and an input_schema")
        name, desc, schema = t.get("name"), t.get("description"), t.get("input_schema")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad(f"{where}.name", "must be 1-128 letters, digits, underscores or dashes")
        if any(d[0] == name for d in defined):
            raise bad(f"{where}.name", f"two tools are named {name!r}")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{where}.description", "expected a string")
        if not isinstance(schema, dict):
            raise bad(f"{where}.input_schema", "expected a JSON schema object")
        defined.append((name, desc, schema))
    if len(defined) > MAX_TOOLS:
        raise bad("tools", f"at most {MAX_TOOLS} tools, got {len(defined)}")
    kind = (choice or {}).get("type", "auto")
    parallel = (choice or {}).get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "expected a boolean")
    named = None
    if kind == "tool":
        named = choice.get("name")
        if not any(d[0] == named for d in defined):
            raise bad("tool_choice.name", f"no tool is named {named!r}")
    elif kind not in ("auto", "any", "none"):
        raise bad("tool_choice.type", f"must be one of auto, any, tool, none, got {kind!r}")
    if not defined:
        if kind in ("any", "tool"):
            raise bad("tool_choice", "forces a tool call, but no tools are given")
        return None
    choice_name = {"any": "required", "tool": "function"}.get(kind, kind)
    return tool_request(defined, choice_name, named, not parallel, chat_template)


def _output_format(body: rq.Body) -> Constraint | None:
    config = body.get("output_config", "dict") or {}
    found = [("output_config.format", config.get("format"))] if config.get("format") is not None else []
    if body.data.get("output_format") is not None:
        found.append(("output_format", body.data["output_format"]))
    if len(found) > 1:
        raise bad("output_format", "give output_config.format or output_format, not both")
    if not found:
        return None
    where, fmt = found[0]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad(f"{where}.type", "only json_schema output formats are supported")
    if not isinstance(fmt.get("schema"), dict):
        raise bad(f"{where}.schema", "expected a JSON schema object")
    return Constraint("json_schema", fmt["schema"], param=where)
