"""Grammars too large or too slow for a request, built on demand (never stored): the engine's
grammar limits (tests/engine/test_grammar_limits.py) and the hostile requests of a real server
(tests/serving/test_hostile.py) both send them."""

from __future__ import annotations


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"'


def defs_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def object_of(n: int, required: bool = False) -> dict:
    s = {"type": "object", "properties": {f"p{i}": {} for i in range(n)}}
    return {**s, "required": list(s["properties"])} if required else s


# A compile that takes long within every limit (38 s on a 2-core host): keys matched by patterns
SLOW = {"type": "object", "patternProperties": {f"^x{i}[a-z]*$": {"type": "string"} for i in range(500)}}
