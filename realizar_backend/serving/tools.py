"""Tool calling for chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The model's own chat template renders the tools (and past tool calls and results), so a model
is asked for calls in the syntax it was trained on; that syntax is chosen from the template:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5, Qwen3,
  Hermes), a bare call object as the whole reply (what small Qwen2.5 models write), or a call
  object in a fenced ```json block (which they write too);
- qwen_xml: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n
  </tool_call>` blocks (Qwen3-Coder, Qwen3.5: their templates spell `<function=`), see tool_xml.py;
- llama3_json: the reply is `{"name": ..., "parameters": {...}}` (Llama 3.1 / 3.2).
A template that never renders tools gets a 400 when tools are asked for. The grammars that hold
calls to the tools' schemas are tool_grammars.py's.

Decoding is constrained (engine/guidance.py) for every tool_choice but `none`: with `required` or
a named function the reply is calls only (one for a named function, for a bare call object, or
when parallel_tool_calls is false) whose arguments follow the function's parameter schema; with
`auto` the model may answer in text, but a call it starts is held to the same schemas. The reply
is parsed into OpenAI `tool_calls` (`parse_reply`), or, streaming, into OpenAI-style deltas
(`ToolStreamParser`): a call's id, type and name first, then its arguments as they are generated.
The arguments string is the model's own JSON text of the arguments object (qwen_xml: the
parameters written as JSON), the same whole or streamed.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..engine.guidance import Constraint
from ..errors import RequestError
from ..model.chat_template import is_harmony
from . import tool_grammars, tool_xml
from .json_scan import ObjectScanner, member_spans

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _bad(param: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code=code)


# ------------------------------------------------------------------------------ formats

@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str | None      # text that opens a call (None: the reply itself is the call)
    close: str | None
    args_key: str         # the key of the arguments in a call's JSON


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
QWEN_XML = ToolFormat("qwen_xml", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", None, None, "parameters")
# gpt-oss's harmony format: a call is a commentary message to functions.NAME; harmony.py parses it
HARMONY = ToolFormat("harmony", None, None, "arguments")
_FENCE_OPEN, _FENCE_CLOSE = "```json", "```"       # a hermes call in a fenced JSON block
_PYTHON_TAG = "<|python_tag|>"     # Llama's marker before a JSON call (a special token: not in the text)


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call syntax a chat template teaches, or None if it never renders tools."""
    if not chat_template or not re.search(r"\btools\b", chat_template):
        return None
    if is_harmony(chat_template):
        return HARMONY
    if "<tool_call>" in chat_template:
        return QWEN_XML if "<function=" in chat_template else HERMES
    if '"parameters"' in chat_template:
        return LLAMA3_JSON
    return None


# ------------------------------------------------------------------------------ the request

@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict       # JSON schema of the arguments object


@dataclass
class ToolRequest:
    """A chat request's tools, checked. `template_tools` go to the chat template (None: render
    none); `constraint(guidance)` is the grammar for the reply; parse with `parse_reply` or a
    `ToolStreamParser`."""
    format: ToolFormat | None
    functions: dict[str, Function]       # by name, in request order
    choice: str                          # none | auto | required | function
    named: str | None                    # the function of choice == "function"
    parallel: bool
    template_tools: list[dict] | None = field(default=None)

    def constraint(self, guidance, reasoning=None) -> Constraint | None:
        """The grammar the reply is held to (None for tool_choice none). guidance: the engine's
        Guidance (it knows whether the call markers are special tokens of the vocabulary);
        reasoning: the model's ReasoningFormat when its template thinks (a thought may come first)."""
        if self.choice == "none" or self.format is None:
            return None
        if self.format is HARMONY:
            if self.choice == "auto":
                return None    # free: the model answers or calls in its own format (harmony.py parses it)
            fns = [self.functions[self.named]] if self.choice == "function" else list(self.functions.values())
            return Constraint("lark", tool_grammars.harmony_grammar(guidance, fns), param="tools")
        fns = [self.functions[self.named]] if self.choice == "function" else list(self.functions.values())
        one_call = self.choice == "function" or not self.parallel
        forced, f = self.choice != "auto", self.format
        if f is QWEN_XML:
            lark = tool_grammars.xml_grammar(guidance, fns, forced, one_call, f.open, f.close)
        elif f is HERMES:
            schema = tool_grammars.calls_schema(fns, f.args_key)
            lark = tool_grammars.hermes_grammar(guidance, schema, forced, one_call, f.open, f.close)
        else:
            schema = tool_grammars.calls_schema(fns, f.args_key)
            lark = tool_grammars.llama3_grammar(guidance, schema, forced, _PYTHON_TAG)
        if reasoning is not None:
            lark = tool_grammars.with_thought(guidance, lark, reasoning)
        return Constraint("lark", lark, param="tools")


def parse_tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None,
                       chat_template: str | None = None) -> ToolRequest | None:
    """Check a request's tool fields (OpenAI's shapes); None when it has no tools. RequestError
    (400, naming the field) for anything malformed, an unknown function in tool_choice, or tools
    for a model whose template has no tool support."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", "expected a boolean", "invalid_type")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "only allowed when tools are given")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "expected an array of tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    defined: list[tuple[str, str | None, dict]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, "expected an object", "invalid_type")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "expected an object", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, underscores or dashes")
        if any(name == d[0] for d in defined):
            raise _bad(f"{where}.function.name", f"two tools are named {name!r}")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description", "expected a string", "invalid_type")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        elif not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "expected a JSON schema object", "invalid_type")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{where}.function.strict", "expected a boolean", "invalid_type")
        defined.append((name, desc, params))
    names = [d[0] for d in defined]
    choice, named = "auto", None
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice", 'expected "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}')
        if fn["name"] not in names:
            raise _bad("tool_choice", f"no tool is named {fn['name']!r} (tools: {', '.join(names)})")
        choice, named = "function", fn["name"]
    else:
        raise _bad("tool_choice", 'expected "none", "auto", "required" or a function', "invalid_type")
    return tool_request(defined, choice, named, parallel_tool_calls is not False, chat_template)


def tool_request(defined: list[tuple[str, str | None, dict]], choice: str, named: str | None, parallel: bool,
                 chat_template: str | None) -> ToolRequest:
    """The ToolRequest of checked, distinct function definitions ((name, description, parameters
    schema), in request order) whatever API they came in: choice is none | auto | required |
    function (then `named` is one of them). A 400 for tools on a model whose template has none."""
    fmt = detect_format(chat_template)
    if fmt is None and choice != "none":
        raise _bad("tools", "this model's chat template has no tool support; tool calls need a model whose "
                            "template renders tools (e.g. Qwen2.5's)", "tools_not_supported")
    functions = {name: Function(name, params) for name, _, params in defined}
    rendered = [{"type": "function", "function": {k: v for k, v in (("name", name), ("description", desc),
                                                                   ("parameters", params)) if v is not None}}
                for name, desc, params in defined]
    return ToolRequest(fmt, functions, choice, named, parallel, rendered if choice != "none" else None)


def check_tool_messages(messages: Any) -> list[dict]:
    """The tool parts of chat messages, checked, as the template takes them: for each message,
    the fields to add to its role and content ({} for most): an assistant's `tool_calls` (each
    {id, type, function: {name, arguments (the JSON string)}}), a tool message's `tool_call_id`
    (it must answer a call of an earlier assistant message) and `name`. RequestError naming
    messages[i]... for anything malformed."""
    if not isinstance(messages, list):
        raise _bad("messages", "expected an array", "invalid_type")
    out: list[dict] = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        extra: dict = {}
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls", "expected an array", "invalid_type")
            checked = []
            for j, call in enumerate(calls):
                cw = f"{where}.tool_calls[{j}]"
                if not isinstance(call, dict):
                    raise _bad(cw, "expected an object", "invalid_type")
                cid = call.get("id")
                if not isinstance(cid, str) or not cid:
                    raise _bad(f"{cw}.id", "expected a non-empty string")
                if call.get("type", "function") != "function":
                    raise _bad(f"{cw}.type", "only 'function' tool calls are supported")
                fn = call.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise _bad(f"{cw}.function", "expected {name, arguments}")
                args = fn.get("arguments")
                if args is None or args == "":          # no arguments (some clients send "")
                    args = "{}"
                try:
                    ok = isinstance(args, str) and isinstance(json.loads(args), dict)
                except ValueError:
                    ok = False
                if not ok:
                    raise _bad(f"{cw}.function.arguments", "expected a JSON object, as a string")
                call_ids.add(cid)
                checked.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
            if checked:
                extra["tool_calls"] = checked
        elif isinstance(m, dict) and m.get("role") == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise _bad(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
            if tid not in call_ids:
                raise _bad(f"{where}.tool_call_id", f"no earlier assistant message made a tool call with id {tid!r}")
            extra["tool_call_id"] = tid
            if m.get("name") is not None:
                if not isinstance(m["name"], str):
                    raise _bad(f"{where}.name", "expected a string", "invalid_type")
                extra["name"] = m["name"]
        out.append(extra)
    return out


# ------------------------------------------------------------------------------ parsing

@dataclass
class ToolCall:
    name: str
    arguments: str                        # the arguments object as JSON text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from_json(text: str, req: ToolRequest) -> ToolCall | None:
    """One call's JSON text -> ToolCall; None unless it is {"name": <a tool>, arguments} with the
    arguments an object (under "arguments" or "parameters", or a string holding one)."""
    spans = member_spans(text)
    if spans is None or "name" not in spans:
        return None
    name = json.loads(text[slice(*spans["name"])])
    if not isinstance(name, str) or (req.functions and name not in req.functions):
        return None
    key = next((k for k in (req.format.args_key if req.format else "arguments", "arguments", "parameters")
                if k in spans), None)
    if key is None:
        return ToolCall(name, "{}")
    raw = text[slice(*spans[key])]
    value = json.loads(raw)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
        raw = json.dumps(value, ensure_ascii=False)
    return ToolCall(name, raw) if isinstance(value, dict) else None


def parse_reply(text: str, req: ToolRequest) -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (content, tool calls): what the streamed deltas of the same text add up
    to (it is parsed the same way). A block that is not a call of one of the tools stays in the
    content; a call cut short (max_tokens) keeps the arguments generated so far, as OpenAI's do."""
    p = ToolStreamParser(req)
    return assemble(p.feed(text) + p.finish())


def assemble(deltas: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """Streamed deltas -> (content, tool calls), the way a client joins them."""
    content: str | None = None
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", ()):
            fn = tc["function"]
            if "id" in tc:
                calls[tc["index"]] = ToolCall(fn["name"], fn["arguments"], tc["id"])
            else:
                calls[tc["index"]].arguments += fn["arguments"]
    if content is None and not calls:
        content = ""
    return content, [calls[k] for k in sorted(calls)]


def finish_reason(engine_reason: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the reply ended with calls, else the engine's."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CALL_START = '{"name":'


def _may_be_call(body: str) -> bool:
    """Whether a fenced block's text so far may still be a call object ({"name": ...)."""
    head = "".join(body.split())[:len(_CALL_START)]
    return _CALL_START.startswith(head) or head.startswith(_CALL_START)
_ARGS_NEXT = re.compile(r'\s*,\s*"(arguments|parameters)"\s*:\s*')


class ToolStreamParser:
    """A reply's text deltas -> OpenAI chat deltas: {"content": ...} pieces and {"tool_calls":
    [...]} pieces (a call's index, id, type and name first, then its arguments as they are
    generated). parse_reply is this parser run over the whole text, so streamed and whole
    replies agree however the text is split.

    A call is a marked block (hermes and qwen_xml: <tool_call> ... </tool_call>; hermes also a
    fenced ```json block; anywhere in the reply) or a bare JSON call object at the start of the
    reply or right after another call (llama3_json's only form; small Qwen models also answer this
    way). A marked block that is not a call of one of the tools stays content (a fenced block is
    given up as soon as it cannot be one, so that a code answer streams on). Whitespace next to a
    call is not content."""

    def __init__(self, req: ToolRequest):
        self.req = req
        self.n_calls = 0
        self._buf = ""               # text not yet handled
        self._held = ""              # whitespace held back from the content
        self._mode = "start"         # start (only whitespace so far) | text | marked | bare
        self._after_call = False
        self._body = ""              # the open call's text
        self._call: dict = {}        # the open call's streaming state
        self._obj: ObjectScanner | None = None   # where a bare call's object ends
        f = req.format
        # the (open, close) markers of a marked block in this format
        self._markers = [] if f is None or f.open is None else \
            [(f.open, f.close)] + ([(_FENCE_OPEN, _FENCE_CLOSE)] if f is HERMES else [])
        self._pair: tuple[str, str] = ("", "")    # the open block's markers

    @property
    def active(self) -> bool:
        return self.req.choice != "none" and self.req.format is not None

    def feed(self, text: str) -> list[dict]:
        if not self.active:
            return [{"content": text}] if text else []
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[dict]:
        """The end of the reply: what was held back, and a call left open (cut short)."""
        return self._run(final=True) if self.active else []

    def _run(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._mode == "start":
                rest = self._buf.lstrip()
                self._held += self._buf[:len(self._buf) - len(rest)]
                self._buf = rest
                if not rest:
                    if final:
                        self._content("", out, final=True)
                    return out
                self._mode = "text"
                if rest[0] == "{" and self.req.format is not QWEN_XML:
                    self._open("bare")
                continue
            if self._mode == "text":
                hits = [(a, pair) for pair in self._markers for a in [self._buf.find(pair[0])] if a >= 0]
                if not hits:
                    # a tail that may be the start of a marker waits for the next delta
                    keep = len(self._buf)
                    if not final:
                        keep -= max((k for op, _ in self._markers
                                     for k in range(min(len(op) - 1, len(self._buf)), 0, -1)
                                     if op.startswith(self._buf[-k:])), default=0)
                    self._content(self._buf[:keep], out, final)
                    self._buf = self._buf[keep:]
                    return out
                a, pair = min(hits)
                self._content(self._buf[:a], out, final=False)
                self._buf = self._buf[a + len(pair[0]):]
                self._open("marked", pair)
                continue
            if self._mode == "marked":
                op, close = self._pair
                # the closing marker may straddle deltas: look for it in the call's text so far
                start = max(0, len(self._body) - len(close) + 1)
                self._body += self._buf
                self._buf = ""
                b = self._body.find(close, start)
                if b < 0 and op == _FENCE_OPEN and not _may_be_call(self._body):
                    # a fenced block that is not a call (code): content at once, not at its end
                    self._buf, self._body = self._body, ""
                    self._content(op, out, final=False)
                    self._mode = "text"
                    continue
                if b < 0 and not final:
                    self._stream_call(out)
                    return out
                closed = b >= 0
                if closed:
                    self._body, self._buf = self._body[:b], self._body[b + len(close):]
                self._close(out, op + self._body + (close if closed else ""))
                self._mode = "text"
                if not closed:
                    return out
                continue
            # bare: the call ends with its object
            n = self._obj.feed(self._buf)
            self._body += self._buf[:n]
            self._buf = self._buf[n:]
            if not self._obj.done and not final:
                self._stream_call(out)
                return out
            # after a call another may follow; after an object that is not one, text does
            self._mode = "start" if self._close(out, self._body) else "text"

    def _open(self, mode: str, pair: tuple[str, str] = ("", "")) -> None:
        self._mode, self._body, self._pair = mode, "", pair
        self._call = {"sent": False, "emitted": "", "scan": None, "pos": 0, "writer": None}
        self._obj = ObjectScanner() if mode == "bare" else None

    @property
    def _xml(self) -> bool:
        """The open block is a qwen_xml call (not JSON)."""
        return self.req.format is QWEN_XML and self._pair[0] == QWEN_XML.open

    def _stream_xml(self, out: list[dict]) -> None:
        c, body = self._call, self._body
        if not c["sent"]:
            head = tool_xml.function_name(body)
            if head is None or head[0] not in self.req.functions:
                return
            c.update(sent=True, name=head[0], id=ToolCall(head[0], "").id, pos=head[1],
                     writer=tool_xml.ArgumentsWriter(self.req.functions[head[0]].parameters))
            out.append(self._header(c))
        pairs, c["pos"] = tool_xml.parameters(body, c["pos"])
        piece = "".join(c["writer"].piece(k, v) for k, v in pairs)
        if piece:
            c["emitted"] += piece
            out.append(self._args(piece))

    def _content(self, text: str, out: list[dict], final: bool) -> None:
        """Text outside calls. Whitespace waits until text follows it (it is not content next to
        a call, nor after the last call)."""
        text = self._held + text
        self._held = ""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if final:
            if self.n_calls:
                text = text.rstrip()
        else:
            keep = len(text.rstrip())
            text, self._held = text[:keep], text[keep:]
        if text:
            out.append({"content": text})

    def _stream_call(self, out: list[dict]) -> None:
        if self._xml:
            return self._stream_xml(out)
        c, body = self._call, self._body
        if not c["sent"]:
            m = _NAME_FIRST.match(body)
            if m is None:
                return
            try:
                name = json.loads('"' + m.group(1) + '"')
            except ValueError:
                return
            if name not in self.req.functions:
                return
            c.update(sent=True, name=name, id=ToolCall(name, "").id, pos=m.end())
            out.append(self._header(c))
        if c["scan"] is None:
            m = _ARGS_NEXT.match(body, c["pos"])
            if m is None or m.end() >= len(body) or body[m.end()] != "{":
                return
            c["scan"], c["pos"] = ObjectScanner(), m.end()
        scan: ObjectScanner = c["scan"]
        if scan.done:
            return
        n = scan.feed(body[c["pos"]:])
        piece = body[c["pos"]:c["pos"] + n]
        c["pos"] += n
        if piece:
            c["emitted"] += piece
            out.append(self._args(piece))

    def _close(self, out: list[dict], block: str) -> bool:
        """The open call's text is complete (or the reply ended): emit what is left of it.
        Returns whether it was a call."""
        self._stream_call(out)
        c = self._call
        if self._xml:
            got = tool_xml.arguments(self._body, {k: f.parameters for k, f in self.req.functions.items()})
            call = ToolCall(*got) if got is not None else None
        else:
            call = _call_from_json(self._body, self.req)
        if call is None and not c["sent"]:
            # not a call: its text is content, with the whitespace held before it
            out.append({"content": self._held + block})
            self._held = ""
            self._after_call = False
            return False
        self._held = ""
        if call is not None:
            if not c["sent"]:
                c.update(sent=True, name=call.name, id=call.id)
                out.append(self._header(c))
            if call.arguments.startswith(c["emitted"]) and len(call.arguments) > len(c["emitted"]):
                out.append(self._args(call.arguments[len(c["emitted"]):]))
        # else: announced, then malformed (cut short): what was sent cannot be taken back
        self.n_calls += 1
        self._after_call = True
        return True

    def _header(self, c: dict) -> dict:
        return {"tool_calls": [{"index": self.n_calls, "id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": ""}}]}

    def _args(self, piece: str) -> dict:
        return {"tool_calls": [{"index": self.n_calls, "function": {"arguments": piece}}]}


def delta_chunks(deltas: list[dict]) -> list[dict]:
    """A step's deltas as the chat deltas OpenAI streams: a call's header (index, id, type, name,
    empty arguments) alone, then its argument pieces joined, content pieces joined; one chunk
    per delta returned, in order."""
    out: list[dict] = []
    for d in deltas:
        last = out[-1] if out else None
        if "content" in d:
            if last is not None and "content" in last:
                last["content"] += d["content"]
            else:
                out.append({"content": d["content"]})
        for tc in d.get("tool_calls", ()):
            prev = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
            if "id" not in tc and prev is not None and "id" not in prev and prev["index"] == tc["index"]:
                prev["function"]["arguments"] += tc["function"]["arguments"]
            else:
                out.append({"tool_calls": [{**tc, "function": dict(tc["function"])}]})
            last = out[-1]
    return out
