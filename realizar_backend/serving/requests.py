"""Reading and checking OpenAI request bodies: every bad field becomes a 400 naming that field
(`param`) in OpenAI's error shape, never a 422 or a 500.

Policies (docs/serving.md says the same to users):
- the body is JSON (Content-Type application/json, or none); anything else is 415;
- a body over Settings.max_request_bytes is 413, answered before the rest is read;
- a field neither OpenAI nor this server knows is 400 `unknown_parameter` (as OpenAI answers),
  with the nearest known name as a hint, so a typo such as `max_token` never passes silently;
  OpenAI fields that do not change the output here (`user`, `metadata`, `store`, ...) are
  accepted and ignored; fields for features this server lacks are 400 `unsupported_parameter`
  unless they hold their neutral value;
- strings must be valid Unicode: a lone UTF-16 surrogate ("\\ud800") is 400 naming the field;
- arrays and objects nest at most MAX_JSON_DEPTH deep (400 invalid_json).

Bodies are parsed and checked off the event loop (openai.py), and a body with very many JSON
values is parsed by the pure-Python scanner, which lets the event loop run between values (the
C parser holds the GIL for the whole document: ~0.4 s for a million `[1],`).
"""

from __future__ import annotations

import difflib
import json
import json.scanner
import logging
import re
from typing import Any, Callable

from starlette.requests import ClientDisconnect, Request

from ..engine.sampling import SamplingParams
from ..errors import RequestError
from .tools import check_tool_messages

log = logging.getLogger(__name__)

MAX_N = 16                   # choices per request (each is a sequence)
MAX_SEQUENCES = 64           # choices x prompts per request
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
_C_PARSE_VALUES = 50_000           # up to this many `[`, `{` and `,` the C parser takes < ~25 ms
MAX_JSON_CONTAINERS = 20_000       # arrays and objects in one body (a chat of thousands of messages fits)
# arrays and objects inside one another: everything after the parse (the chat template's inputs,
# a schema's compile: llguidance reads 128 levels) walks them recursively
MAX_JSON_DEPTH = 128
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

# Fields by endpoint. "used": implemented; "ignored": OpenAI fields that cannot change the output
# of this server; "unsupported": features it lacks (refused unless neutral, by the handlers).
_COMMON = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed", "stop",
           "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
           # vLLM's sampling extras (the openai client sends them through extra_body)
           "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "prompt_logprobs",
           # vLLM's guided decoding (serving/structured.py)
           "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
           "user"}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "echo", "best_of"}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
    "parallel_tool_calls", "response_format", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "verbosity", "metadata", "store", "service_tier", "prompt_cache_key",
    "safety_identifier",
    # vLLM's chat extras (serving/chat_request.py)
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "max_reasoning_tokens"}
# vLLM's token routes
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs", "messages", "add_generation_prompt",
                   "continue_final_message", "tools", "chat_template_kwargs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str | None, message: str, code: str | None = None) -> RequestError:
    return RequestError(message, status=400, param=param, code=code)


class ClientGone(Exception):
    """The client closed the connection before its request was queued (while sending its body,
    or while the request was checked)."""

    def __init__(self, message: str = "the client left while sending its request body"):
        super().__init__(message)


# ------------------------------------------------------------------------------ the body
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or an array of strings"),
    "ints": (lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v),
             "an array of integers"),
}


class Body:
    """Typed access to a JSON request body; a missing or null field takes its default."""

    def __init__(self, data: dict):
        self.data = data

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        v = self.data.get(name)
        if v is None:
            return default
        ok, what = _KINDS[kind]
        if not ok(v):
            raise bad(name, f"{name}: expected {what}, got {type(v).__name__} {json.dumps(v)[:60]}",
                      "invalid_type")
        return v

    def require(self, name: str, kind: str) -> Any:
        v = self.get(name, kind)
        if v is None:
            raise bad(name, f"{name}: this field is required", "missing_required_parameter")
        return v

    def unsupported(self, name: str, allowed: Callable[[Any], bool] = lambda v: not v) -> None:
        v = self.data.get(name)
        if v is not None and not allowed(v):
            raise bad(name, f"{name}: not supported by this server", "unsupported_parameter")

    def only(self, known: set[str]) -> None:
        """Refuse fields this endpoint does not know (OpenAI's answer to them, a 400)."""
        for name in self.data:
            if name not in known:
                near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise bad(name, f"Unrecognized request argument supplied: {name}{hint}", "unknown_parameter")


def _media_type_ok(content_type: str | None) -> bool:
    if not content_type:
        return True                      # scripts often send none; the body must still be JSON
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to pass `limit` bytes."""
    if not _media_type_ok(request.headers.get("content-type")):
        raise RequestError(f"the request body must be JSON (Content-Type: application/json), not "
                           f"{request.headers.get('content-type')!r}", status=415, code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is larger than this server accepts ({limit} bytes; "
                        f"REALIZAR_MAX_REQUEST_BYTES)", status=413, code="request_too_large")


def parse_json(raw: bytes) -> Body:
    """The body as a JSON object (blocking: run it off the event loop)."""
    try:
        text = raw.decode("utf-8")
        if raw.count(b"[") + raw.count(b"{") + raw.count(b",") > _C_PARSE_VALUES:
            data = _slow_decoder().decode(text)
        else:
            data = json.loads(text)
    except _TooManyContainers:
        raise bad(None, f"the request body holds more than {MAX_JSON_CONTAINERS} JSON arrays and objects",
                  "invalid_json") from None
    except RecursionError:
        raise bad(None, "the request body nests JSON more deeply than this server reads", "invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise bad(None, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nests_deeper(data, MAX_JSON_DEPTH):
        raise bad(None, f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} deep",
                  "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(data)
    return Body(data)


class _TooManyContainers(Exception):
    pass


def _nests_deeper(data: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep (iterative: the point is depth)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        for child in (v.values() if isinstance(v, dict) else v):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _slow_decoder() -> json.JSONDecoder:
    """The pure-Python JSON scanner (it lets other threads run between values), stopped past
    MAX_JSON_CONTAINERS arrays and objects: a million small arrays would cost the process a
    garbage collection pass of hundreds of milliseconds, with everything else held."""
    decoder = json.JSONDecoder()
    made = [0]

    def counted(parse):
        def parse_container(*args, **kwargs):
            made[0] += 1
            if made[0] > MAX_JSON_CONTAINERS:
                raise _TooManyContainers()
            return parse(*args, **kwargs)
        return parse_container

    decoder.parse_array = counted(json.decoder.JSONArray)
    decoder.parse_object = counted(json.decoder.JSONObject)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


def _check_unicode(data: Any) -> None:
    """Refuse a string holding a lone surrogate (JSON allows the escape, UTF-8 cannot hold it)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                # the path itself may hold the surrogate (a key): show it escaped
                param = where.lstrip(".").encode("utf-8", "backslashreplace").decode("utf-8") or None
                raise bad(param, f"{param or 'the body'}: holds a lone UTF-16 surrogate, which is not valid "
                                 f"Unicode", "invalid_unicode") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((f"{where}.{k}", x))
                stack.append((f"{where}.{k}", k))     # keys are strings too
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))


# ------------------------------------------------------------------------------ fields
def check_model(body: Body, engine) -> None:
    model = body.require("model", "str")
    if model != engine.model_name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
                           status=404, param="model", code="model_not_found")


def sampling(body: Body, max_tokens: int | None, logprobs: int | None, max_stop_chars: int) -> SamplingParams:
    """The engine's sampling fields under their OpenAI names (and vLLM's for the extras);
    ranges are checked by SamplingParams.validate inside engine.prepare."""
    stop = body.get("stop", "stop", [])
    for s in [stop] if isinstance(stop, str) else stop:
        if len(s) > max_stop_chars:
            raise bad("stop", f"stop: each stop string may have at most {max_stop_chars} characters, "
                              f"one has {len(s)}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.get("temperature", "number", 1.0),
        top_p=body.get("top_p", "number", 1.0),
        top_k=body.get("top_k", "int", 0),
        min_p=body.get("min_p", "number", 0.0),
        repetition_penalty=body.get("repetition_penalty", "number", 1.0),
        presence_penalty=body.get("presence_penalty", "number", 0.0),
        frequency_penalty=body.get("frequency_penalty", "number", 0.0),
        seed=body.get("seed", "int"),
        stop=stop,
        stop_token_ids=body.get("stop_token_ids", "ints", []),
        ignore_eos=body.get("ignore_eos", "bool", False),
        logprobs=logprobs,
        logit_bias=body.get("logit_bias", "dict"),
        min_tokens=body.get("min_tokens", "int", 0),
    )


def no_prompt_logprobs(body: Body) -> None:
    """vLLM's prompt_logprobs needs the logits of every prompt position; a prefill computes only
    its last position's (on the GPU the LM head runs on those rows alone), and prompt tokens found
    in the prefix cache are not computed at all. Refused unless null."""
    if body.data.get("prompt_logprobs") is not None:
        raise bad("prompt_logprobs", "prompt_logprobs: not supported by this server (prompt positions' logits "
                                     "are not computed: only the last position's, and none for a cached prefix)",
                  "unsupported_parameter")


def choices(body: Body, prompts: int, max_waiting: int) -> int:
    """`n`, checked against the per-request bounds and against the server's queue: a request
    needing more sequences than can ever wait at once is refused here, not answered 503."""
    n = body.get("n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"n: must be between 1 and {MAX_N}, got {n}")
    if n * prompts > MAX_SEQUENCES:
        raise bad("n", f"n x prompts must be at most {MAX_SEQUENCES}, got {n * prompts}")
    if n * prompts > max_waiting:
        raise bad("n", f"n x prompts ({n * prompts}) is more sequences than this server queues at once "
                       f"({max_waiting}, REALIZAR_MAX_WAITING)")
    return n


def stream_options(body: Body, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): a last chunk with the usage, and (vLLM's, with
    include_usage) the usage so far in every chunk."""
    opts = body.get("stream_options", "dict")
    if opts is None:
        return False, False
    if not stream:
        raise bad("stream_options", "stream_options: only allowed when stream is true")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        v = opts.get(name, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise bad("stream_options", f"stream_options.{name}: expected a boolean", "invalid_type")
        flags.append(v)
    return flags[0], flags[0] and flags[1]


def prompts(body: Body) -> list[str | list[int]]:
    p = body.data.get("prompt")
    if p is None:
        raise bad("prompt", "prompt: this field is required", "missing_required_parameter")
    if isinstance(p, str) or _KINDS["ints"][0](p) and p:
        return [p]
    if isinstance(p, list) and len(p) > MAX_SEQUENCES:
        raise bad("prompt", f"prompt: at most {MAX_SEQUENCES} prompts in one request, got {len(p)}")
    if isinstance(p, list) and p and all(isinstance(x, str) or (_KINDS["ints"][0](x) and x) for x in p):
        return list(p)
    raise bad("prompt", "prompt: expected a string, an array of strings, an array of token ids "
                        "or an array of arrays of token ids", "invalid_type")


def messages(body: Body) -> list[dict]:
    """The chat messages as the template takes them: role, text content, and the tool fields
    (an assistant's tool_calls, a tool message's tool_call_id and name), all checked."""
    msgs = body.require("messages", "list")
    if not msgs:
        raise bad("messages", "messages: must contain at least one message")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where}: expected an object", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"{where}.role: must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content", f"{where}.content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content: expected a string or an array of text parts",
                      "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    extras = check_tool_messages(msgs)
    return [{**m, **x} for m, x in zip(out, extras)]
