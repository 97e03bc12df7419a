"""The body of a qwen_xml tool call (Qwen3-Coder, Qwen3.5): between `<tool_call>` and
`</tool_call>`,

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

read into OpenAI's arguments, the JSON text of an object. A value is converted by its parameter's
schema: a string stays the text as written; any other value is read as JSON (the templates write
objects and arrays with `tojson`, numbers as they are; Python's True / False / None, which a
template's `| string` writes, are read too); text that is not JSON stays a string.

The arguments are written one member at a time (`{"city": "Paris"`, then `, "days": 3`, then `}`),
so a streamed call sends each parameter as soon as its `</parameter>` arrives, and the pieces join
to exactly the whole call's arguments. A name given twice keeps its first value.
"""

from __future__ import annotations

import json
import re
from typing import Any

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def function_name(body: str) -> tuple[str, int] | None:
    """(the call's function name, where its parameters start), once the opening line is complete."""
    m = FUNCTION.match(body)
    return (m.group(1).strip(), m.end()) if m else None


def parameters(body: str, pos: int) -> tuple[list[tuple[str, str]], int]:
    """The complete parameters (name, raw value) from pos on, and where the next one would start."""
    out = []
    while True:
        m = PARAMETER.match(body, pos)
        if m is None:
            return out, pos
        out.append((m.group(1).strip(), m.group(2)))
        pos = m.end()


def convert(raw: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (kind is None and isinstance(schema, dict) and "enum" in schema
                            and all(isinstance(v, str) for v in schema["enum"])):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        pass
    word = raw.strip()
    if word in _PYTHON_WORDS:
        return _PYTHON_WORDS[word]
    return raw


class ArgumentsWriter:
    """A call's arguments written as its parameters complete."""

    def __init__(self, schema: Any):
        props = schema.get("properties") if isinstance(schema, dict) else None
        self.props = props if isinstance(props, dict) else {}
        self.seen: set[str] = set()

    def piece(self, name: str, raw: str) -> str:
        """The arguments' text for one more parameter ("" for a name already given)."""
        if name in self.seen:
            return ""
        first = not self.seen
        self.seen.add(name)
        value = convert(raw, self.props.get(name))
        member = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        return ("{" if first else ", ") + member

    def end(self) -> str:
        return "}" if self.seen else "{}"


def arguments(body: str, schemas: dict[str, Any]) -> tuple[str, str] | None:
    """(function name, arguments JSON) of a whole call body; None unless it names one of schemas
    (function name -> parameters schema)."""
    head = function_name(body)
    if head is None or head[0] not in schemas:
        return None
    name, pos = head
    w = ArgumentsWriter(schemas[name])
    pairs, _ = parameters(body, pos)
    return name, "".join(w.piece(k, v) for k, v in pairs) + w.end()
