"""Reading JSON objects as text: where each top-level member's value lies in an object's text
(so a tool call's arguments keep the model's own spelling), and where an object that is still
arriving ends (strings, escapes and nesting followed one character at a time)."""

from __future__ import annotations

import json


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def member_spans(s: str) -> dict[str, tuple[int, int]] | None:
    """Where each top-level member's value lies in the JSON object text s; None if s is not one."""
    dec = json.JSONDecoder()
    try:
        i = _skip_ws(s, 0)
        if s[i] != "{":
            return None
        spans: dict[str, tuple[int, int]] = {}
        i = _skip_ws(s, i + 1)
        if s[i] == "}":
            return spans if not s[i + 1:].strip() else None
        while True:
            key, i = dec.raw_decode(s, i)
            i = _skip_ws(s, i)
            if not isinstance(key, str) or s[i] != ":":
                return None
            i = _skip_ws(s, i + 1)
            _, j = dec.raw_decode(s, i)
            spans[key] = (i, j)
            i = _skip_ws(s, j)
            if s[i] == ",":
                i = _skip_ws(s, i + 1)
                continue
            if s[i] == "}" and not s[i + 1:].strip():
                return spans
            return None
    except (ValueError, IndexError):
        return None


class ObjectScanner:
    """Follows a JSON object's text as it arrives and says where it ends (depth, strings, escapes)."""

    def __init__(self):
        self.depth = 0
        self.in_str = self.esc = False
        self.done = False

    def feed(self, s: str) -> int:
        """Consume s; returns how many characters belong to the object (all of s, unless it ends inside)."""
        for k, ch in enumerate(s):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return k + 1
        return len(s)
