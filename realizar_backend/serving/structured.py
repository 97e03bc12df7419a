"""Structured output requests: OpenAI's `response_format` (chat) and vLLM's guided-decoding
fields (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or the same under
`structured_outputs`; completions and chat) as one engine Constraint (engine/guidance.py).
Only the shapes are checked here; whether a schema or grammar can be used is checked when the
engine compiles it (a 400 naming the field either way)."""

from __future__ import annotations

import json
import re
from typing import Any

from ..engine.guidance import Constraint
from ..errors import RequestError

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# vLLM's names -> constraint kinds
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "lark"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _bad(param: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code=code)


def response_format(value: Any) -> Constraint | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("response_format", "expected an object", "invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", param="response_format")
    if kind != "json_schema":
        raise _bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema", "expected an object with name and schema", "invalid_type")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise _bad("response_format.json_schema.name", "must be 1-64 letters, digits, underscores or dashes")
    for key, ok in (("strict", lambda v: isinstance(v, bool)), ("description", lambda v: isinstance(v, str))):
        if js.get(key) is not None and not ok(js[key]):
            raise _bad(f"response_format.json_schema.{key}", "wrong type", "invalid_type")
    schema = js.get("schema")
    if schema is None:
        schema = {}             # OpenAI: no schema means any JSON value
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "expected a JSON schema object", "invalid_type")
    # the output always follows the schema; strict (OpenAI's subset) changes nothing here
    return Constraint("json_schema", schema, param="response_format")


def guided(data: dict) -> Constraint | None:
    """vLLM's guided-decoding fields of a request body (at most one of them)."""
    found = [(f, _GUIDED[f], data[f]) for f in _GUIDED if data.get(f) is not None]
    so = data.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "expected an object", "invalid_type")
        found += [(f"structured_outputs.{k}", _STRUCTURED[k], so[k]) for k in _STRUCTURED if so.get(k) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise _bad(found[1][0], f"only one guided-decoding field per request (also given: {found[0][0]})")
    param, kind, spec = found[0]
    if kind == "json_schema" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise _bad(param, f"not valid JSON: {e}") from None
    if kind == "json_schema" and not isinstance(spec, dict):
        raise _bad(param, "expected a JSON schema object", "invalid_type")
    if kind in ("regex", "lark") and not isinstance(spec, str):
        raise _bad(param, "expected a string", "invalid_type")
    if kind == "choice" and not (isinstance(spec, list) and spec and all(isinstance(s, str) for s in spec)):
        raise _bad(param, "expected a non-empty array of strings", "invalid_type")
    return Constraint(kind, spec, param=param)


def names_constraint(data: dict) -> bool:
    """Whether a request body gives any field that asks for a grammar (whose compilation blocks)."""
    return data.get("response_format") is not None or data.get("structured_outputs") is not None \
        or any(data.get(f) is not None for f in _GUIDED)


def request_constraint(data: dict, chat: bool) -> Constraint | None:
    """The one constraint of a completions (chat=False) or chat request body, or None."""
    rf = response_format(data.get("response_format")) if chat else None
    g = guided(data)
    if rf is not None and g is not None:
        raise _bad(g.param, "cannot be combined with response_format")
    if not chat and data.get("response_format") is not None:
        raise _bad("response_format", "is a chat completions field; completions take guided_json and the like")
    return rf or g
