"""The grammars that hold a reply's tool calls to the tools' schemas (llguidance's Lark dialect),
one per call syntax of serving/tools.py:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, or one bare
  call object as the whole reply; llama3_json: the reply is `{"name": ..., "parameters": {...}}`.
  A call is a JSON object checked against one schema: {name: const, arguments: the function's
  parameters}, one such schema per function (anyOf);
- qwen_xml (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
  </parameter>\\n...</function>\\n</tool_call>`. Each function's parameters come in the order of
  its schema's properties (the required ones always, the others optionally); a string value is
  any text up to the line `</parameter>`, one of an enum's strings, and any other value is JSON
  of its schema.

Tool schemas often name shared parts (`$defs`, or the older `definitions`) and refer to them
(`{"$ref": "#/$defs/Address"}`). Nested under a call's `arguments`, such a pointer would no longer
lead anywhere, so each function's parts are hoisted to the call schema's root under names of
their own (`tool0_Address`), and its references rewritten to them (`prepare_parameters`).

For a model whose template thinks, every grammar lets a thought come first (`with_thought`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..engine.guidance import JSON_STYLE

_DEFS_KEYS = ("$defs", "definitions")


def _rewrite_refs(node: Any, prefix: str, root_key: str | None) -> Any:
    """A copy of a schema with every local $ref moved: to a hoisted part (#/$defs/<prefix><name>)
    or, for one into the schema itself, under #/$defs/<root_key>."""
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix, root_key) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str):
            for defs in _DEFS_KEYS:
                head = f"#/{defs}/"
                if v.startswith(head):
                    v = f"#/$defs/{prefix}{v[len(head):]}"
                    break
            else:
                if root_key is not None and (v == "#" or v.startswith("#/")):
                    v = f"#/$defs/{root_key}{v[1:]}"
            out[k] = v
        else:
            out[k] = _rewrite_refs(v, prefix, root_key)
    return out


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any(k == "$ref" or _has_ref(v) for k, v in node.items())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def prepare_parameters(params: dict, index: int) -> tuple[dict, dict]:
    """(schema to nest where the function's arguments go, parts to add to the root's $defs) for
    the index-th function's parameters. A schema without references is nested as it is."""
    if not _has_ref(params):
        return params, {}
    prefix, root_key = f"tool{index}_", f"tool{index}"
    defs: dict = {}
    body = {k: v for k, v in params.items() if k not in _DEFS_KEYS}
    for key in _DEFS_KEYS:
        for name, part in (params.get(key) or {}).items():
            defs[prefix + name] = _rewrite_refs(part, prefix, root_key)
    defs[root_key] = _rewrite_refs(body, prefix, root_key)
    return {"$ref": f"#/$defs/{root_key}"}, defs


def calls_schema(fns: list, args_key: str) -> dict:
    """The JSON schema of one call of any of fns (Function: name, parameters)."""
    one, defs = [], {}
    for i, f in enumerate(fns):
        args, parts = prepare_parameters(f.parameters, i)
        defs.update(parts)
        one.append({"type": "object", "properties": {"name": {"const": f.name}, args_key: args},
                    "required": ["name", args_key], "additionalProperties": False})
    schema = one[0] if len(one) == 1 else {"anyOf": one}
    if defs:
        schema = {**schema, "$defs": defs}
    return {**schema, "x-guidance": JSON_STYLE}


def marker(guidance, text: str) -> str:
    # a marker that is one special token of the vocabulary must be named as one in the grammar
    return text if guidance.is_special(text) else json.dumps(text)


def hermes_grammar(guidance, schema: dict, forced: bool, one_call: bool, open_: str, close: str) -> str:
    op, cl = marker(guidance, open_), marker(guidance, close)
    lines = ["start: calls | bare" if forced else "start: TEXT | TEXT? calls | bare",
             f'call: {op} "\\n" bare "\\n" {cl}',
             "calls: call" if one_call else 'calls: call ("\\n" call)*',
             # a bare call object is one call: the model stops after it
             f"bare: %json {json.dumps(schema)}"]
    if not forced:
        # text may not start like a bare call, nor contain the opening marker
        lines.append("TEXT: /[^{](.|\\n)*/" if op.startswith("<") else
                     "TEXT: /[^{](.|\\n)*/ & ~/(?s:.*)" + re.escape(open_) + "(?s:.*)/")
    return "\n".join(lines)


def llama3_grammar(guidance, schema: dict, forced: bool, python_tag: str) -> str:
    bare = f"bare: %json {json.dumps(schema)}"
    if forced:
        return "start: bare\n" + bare
    tag = f" | {python_tag} bare" if guidance.is_special(python_tag) else ""
    # the reply is a call, or text that does not start like one
    return f"start: TEXT | bare{tag}\n{bare}\nTEXT: /[^{{](.|\\n)*/"


_PARAM_END = "\n</parameter>\n"


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema


def _string_enum(schema: Any) -> list[str] | None:
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"] \
            and all(isinstance(v, str) for v in schema["enum"]):
        return schema["enum"]
    return None


def xml_grammar(guidance, fns: list, forced: bool, one_call: bool, open_: str, close: str) -> str:
    """The qwen_xml calls of fns (Function: name, parameters)."""
    op, cl = marker(guidance, open_), marker(guidance, close)
    lines = ["start: calls" if forced else "start: TEXT | TEXT? calls",
             "calls: call" if one_call else 'calls: call ("\\n" call)*',
             f'call: {op} "\\n" ({" | ".join(f"f{i}" for i in range(len(fns)))}) "\\n" {cl}']
    for i, f in enumerate(fns):
        params = f.parameters if isinstance(f.parameters, dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
        seq = []
        for j, (name, prop) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            head = json.dumps(f"<parameter={name}>\n")
            if _is_string(prop):
                # any text up to the first line `</parameter>`: one lexeme, its end included, so
                # that no text of the value is taken for its end
                end = _rx(_PARAM_END)
                lines.append(f"{rule.upper()}: /{_rx(f'<parameter={name}>' + chr(10))}(?s:.*){end}/ & "
                             f"~/(?s:.*){end}(?s:.+)/")
                lines.append(f"{rule}: {rule.upper()}")
            elif (choices := _string_enum(prop)) is not None:
                lines.append(f"{rule}: {head} ({' | '.join(json.dumps(c) for c in choices)}) {json.dumps(_PARAM_END)}")
            else:
                value = {**(prop if isinstance(prop, dict) else {}), **defs, "x-guidance": JSON_STYLE}
                lines.append(f"{rule}: {head} %json {json.dumps(value)} {json.dumps(_PARAM_END)}")
            seq.append(rule if name in required else f"{rule}?")
        lines.append(f'f{i}: {json.dumps(f"<function={f.name}>" + chr(10))} {" ".join(seq)} "</function>"')
    if not forced:
        lines.append("TEXT: /(.|\\n)+/" if op.startswith("<") else
                     "TEXT: /(.|\\n)+/ & ~/(?s:.*)" + _rx(open_) + "(?s:.*)/")
    return "\n".join(lines)


def harmony_grammar(guidance, fns: list) -> str:
    """gpt-oss's harmony calls (serving/harmony.py) of fns (Function: name, parameters), for a
    forced tool_choice: an optional thought (an analysis message), then one call, a commentary
    message to functions.NAME whose body is JSON of the function's parameters (the model stops at
    <|call|> after it, so a reply holds one call)."""
    m = {t: marker(guidance, t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")}
    lines = ["start: thought? call",
             f'thought: {m["<|channel|>"]} "analysis" {m["<|message|>"]} THOUGHT? {m["<|end|>"]} '
             f'{m["<|start|>"]} "assistant"',
             "THOUGHT: /(.|\\n)+/",
             f'call: {m["<|channel|>"]} "commentary to=functions." ({" | ".join(f"f{i}" for i in range(len(fns)))})']
    for i, f in enumerate(fns):
        args, defs = prepare_parameters(f.parameters if isinstance(f.parameters, dict) else {}, i)
        schema = {**args, **({"$defs": defs} if defs else {}), "x-guidance": JSON_STYLE}
        lines.append(f'f{i}: {json.dumps(f.name + " ")} {m["<|constrain|>"]} "json" {m["<|message|>"]} '
                     f"%json {json.dumps(schema)}")
    return "\n".join(lines)


def with_thought(guidance, lark: str, fmt) -> str:
    """A tool grammar that lets a thinking model think first: an optional thought (its open tag
    optional too, for a prompt that opened it; then its text and close tag) before what the grammar
    held. fmt: the model's ReasoningFormat (serving/reasoning.py)."""
    head, _, rest = lark.partition("\n")
    assert head.startswith("start: ")
    op, cl = marker(guidance, fmt.open), marker(guidance, fmt.close)
    if cl.startswith('"'):
        # a spelled close tag ends its own lexeme (the thought's text up to the first one), so that
        # no text of the thought is taken for its end
        end = _rx(fmt.close)
        body = [f"thought: {op}? THOUGHT AFTER_THOUGHT?", f"THOUGHT: /(?s:.*){end}/ & ~/(?s:.*){end}(?s:.+)/"]
    else:           # a special token is never inside a text lexeme
        body = [f"thought: {op}? THOUGHT? {cl} AFTER_THOUGHT?", "THOUGHT: /(.|\\n)+/"]
    return "\n".join([f"start: thought? ({head[len('start: '):]})", rest, *body,
                      # a model writes a blank line or two here; no more, so that a weak one cannot
                      # spend its tokens on white space instead of its calls
                      "AFTER_THOUGHT: /[ \\t\\r\\n]{1,4}/"])


def _rx(text: str) -> str:
    """text as a Lark regex literal's body: regex characters escaped, a newline as \\n and a /
    (which would end the literal) escaped."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")
