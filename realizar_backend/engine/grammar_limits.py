"""Structural limits of a constraint (a JSON schema, a Lark grammar, a regex, a choice list),
checked before anything compiles it: measuring costs a pass over the request's own text, while
the compiler's cost grows faster than the text (optional properties and alternatives: about
quadratically) and its recursion follows chains of rule references and `$ref`s, so that one
chain of a few thousand links overflows a thread's stack and takes the process down.

Every limit is far above what real schemas and grammars need (the tool definitions of a coding
agent, a programming language's grammar) and far below where the compiler gets slow or deep; a
constraint past one is a 400 `grammar_too_large` naming the request field and the limit. What
the text alone cannot tell (a grammar that accepts nothing, a compile that runs long) the
compile check finds (engine/grammar_check.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Hashable, Iterable

from ..errors import RequestError

MAX_GRAMMAR_CHARS = 256 << 10       # a constraint's whole text (schema as JSON, grammar, regex, the choices)
MAX_ALTERNATIVES = 4096             # `|` alternatives of a Lark grammar
# choices: one row of the grammar, and llguidance refuses a row of more than 2,000 items
MAX_CHOICES = 1024
MAX_GRAMMAR_RULES = 2000            # rules and terminals of a Lark grammar
MAX_PROPERTIES = 1024               # properties of one JSON schema object
# the longest chain of references (a Lark rule naming the next, a `$ref` to a schema that holds the
# next): the compiler recurses once per link, and a chain of ~2,500 overflows an 8 MiB stack
MAX_REFERENCE_DEPTH = 1000
# a regex with its counted repetitions unrolled (`a{1000}` is 1,000, `(a{100}){100}` 10,000): the
# lexer builds that many states, and past ~100k it gives up with an error at the first token
MAX_REGEX_EXPANSION = 1 << 16

# what each constraint kind is called in errors
WHAT = {"json_object": "JSON object", "json_schema": "JSON schema", "lark": "grammar", "regex": "regex",
        "choice": "choice list"}


def check(kind: str, spec: Any, param: str, text_chars: int) -> None:
    """RequestError (400 grammar_too_large) when a constraint passes a structural limit.
    text_chars: the length of the constraint's text (its JSON form: Constraint.key)."""
    what = WHAT.get(kind, "grammar")
    if text_chars > MAX_GRAMMAR_CHARS:
        raise _too_large(param, f"this {what} is {text_chars:,} characters long; at most {MAX_GRAMMAR_CHARS:,} "
                                f"are accepted")
    if kind == "json_schema":
        schema = spec
        if isinstance(spec, str):
            try:
                schema = json.loads(spec)
            except (ValueError, RecursionError):
                return                  # not JSON: the compiler says so
        _check_schema(schema, param)
    elif kind == "lark" and isinstance(spec, str):
        _check_lark(spec, param)
    elif kind == "regex" and isinstance(spec, str):
        _check_regex(spec, param, "this regex")
    elif kind == "choice" and isinstance(spec, list) and len(spec) > MAX_CHOICES:
        raise _too_large(param, f"{len(spec):,} choices; at most {MAX_CHOICES:,} are accepted")


def _too_large(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code="grammar_too_large")


# ------------------------------------------------------------------------------ chains of references
def longest_chain(nodes: Iterable[Hashable], edges: Callable[[Hashable], Iterable[Hashable]]) -> int:
    """A bound on the longest chain of references through a graph: the heaviest path through its
    strongly connected components, each weighing its size (a path that enters a cycle can visit
    each of its nodes once). Iterative (Tarjan's algorithm): the graphs measured here are the
    deep ones."""
    index: dict = {}
    low: dict = {}
    comp: dict = {}             # node -> its component's number, in the order components complete
    sizes: list[int] = []
    on_stack: set = set()
    stack: list = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges(root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges(child))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                n = len(sizes)
                size = 0
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp[x] = n
                    size += 1
                    if x == node:
                        break
                sizes.append(size)
    # components complete children first: each one's heaviest path is its size plus its heaviest child's
    members: list[list] = [[] for _ in sizes]
    for x, n in comp.items():
        members[n].append(x)
    best = [0] * len(sizes)
    for n, xs in enumerate(members):
        below = max((best[comp[c]] for x in xs for c in edges(x) if comp[c] != n), default=0)
        best[n] = sizes[n] + below
    return max(best, default=0)


def _too_deep(param: str, what: str, depth: int) -> RequestError:
    return _too_large(param, f"this {what} chains {depth:,} references (rules naming rules, $refs, nesting); "
                             f"at most {MAX_REFERENCE_DEPTH:,} are accepted")


# ------------------------------------------------------------------------------ JSON schemas
def _check_schema(schema: Any, param: str) -> None:
    """Properties per object, regex patterns, and the chain of nesting and `$ref`s, every node
    (object or array) of the schema a link."""
    containers: dict[int, Any] = {}
    todo = [schema]
    while todo:
        v = todo.pop()
        if isinstance(v, (dict, list)) and id(v) not in containers:
            containers[id(v)] = v
            todo.extend(v.values() if isinstance(v, dict) else v)
    for v in containers.values():
        if not isinstance(v, dict):
            continue
        props = v.get("properties")
        if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
            raise _too_large(param, f"an object of this JSON schema has {len(props):,} properties; at most "
                                    f"{MAX_PROPERTIES:,} are accepted")
        pattern = v.get("pattern")
        if isinstance(pattern, str):
            _check_regex(pattern, param, "a pattern of this JSON schema")
        pats = v.get("patternProperties")
        if isinstance(pats, dict):
            for p in pats:
                _check_regex(p, param, "a pattern of this JSON schema")

    def edges(key: int) -> list[int]:
        v = containers[key]
        out = [id(c) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
        if isinstance(v, dict) and isinstance(v.get("$ref"), str):
            target = _pointer(schema, v["$ref"])
            if isinstance(target, (dict, list)) and id(target) in containers:
                out.append(id(target))
        return out

    if isinstance(schema, (dict, list)):
        depth = longest_chain([id(schema)], edges)
        if depth > MAX_REFERENCE_DEPTH:
            raise _too_deep(param, "JSON schema", depth)


def _pointer(root: Any, ref: str) -> Any:
    """The part of the schema a local `$ref` ("#", "#/$defs/x") names; None for others."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# ------------------------------------------------------------------------------ Lark grammars
_LARK_TOKEN = re.compile(r"""
    (?P<space>[ \t\r]+)
  | (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<json>%json\b)
  | (?P<special><[^<>\n]*>)
  | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
  | (?P<priority>\.-?\d+)
  | (?P<newline>\n)
  | (?P<bar>\|)
  | (?P<colon>:)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def _check_lark(text: str, param: str) -> None:
    """Rules, alternatives, regex literals, embedded %json schemas, and the chain of rule
    references. A rule or terminal is defined by its name first on a line (after `?` or `!`),
    then `:` (Lark) or `::=` (GBNF); every other name is a reference of the rule being defined."""
    refs: dict[str, list[str]] = {}
    current: list[str] | None = None
    alternatives = 0
    first = True                 # nothing but `?`, `!` or spaces on this line so far
    pending: str | None = None   # a name first on its line: a definition if `:` follows
    pos = 0
    decoder = json.JSONDecoder()
    while pos < len(text):
        m = _LARK_TOKEN.match(text, pos)
        kind, tok = m.lastgroup, m.group()
        pos = m.end()
        if kind in ("space", "comment") or (kind == "priority" and pending is not None):
            continue
        if kind == "newline":
            first, pending = True, None
            continue
        if pending is not None:
            if kind == "colon":
                current = refs.setdefault(pending, [])
                pending = None
                continue
            if current is not None:
                current.append(pending)
            pending = None
        if kind == "name" and first:
            pending = tok
        elif kind == "name" and current is not None:
            current.append(tok)
        elif kind == "bar":
            alternatives += 1
        elif kind == "regex":
            _check_regex(tok[1:tok.rindex("/")], param, "a regex of this grammar")
        elif kind == "json":
            start = pos + len(text[pos:pos + 64]) - len(text[pos:pos + 64].lstrip())
            try:
                schema, end = decoder.raw_decode(text, start)
            except (ValueError, RecursionError):
                continue                 # malformed: the compiler says so
            _check_schema(schema, param)
            pos = end
        first = first and kind == "other" and tok in "?!"
    if len(refs) > MAX_GRAMMAR_RULES:
        raise _too_large(param, f"this grammar defines {len(refs):,} rules and terminals; at most "
                                f"{MAX_GRAMMAR_RULES:,} are accepted")
    if alternatives > MAX_ALTERNATIVES:
        raise _too_large(param, f"this grammar has {alternatives:,} alternatives; at most {MAX_ALTERNATIVES:,} "
                                f"are accepted")
    depth = longest_chain(list(refs), lambda name: [r for r in refs[name] if r in refs])
    if depth > MAX_REFERENCE_DEPTH:
        raise _too_deep(param, "grammar", depth)


# ------------------------------------------------------------------------------ regexes
_QUANTIFIER = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def regex_expansion(pattern: str) -> int:
    """The length of a regex with its counted repetitions unrolled: a sequence adds its parts, an
    alternation takes the longest branch, `x{m,n}` counts x n times (m when open-ended). Escapes
    and character classes are one atom each."""
    # per open group: (sum of the finished branches' maximum, the current branch's running sum)
    groups: list[list[int]] = [[0, 0]]
    last = 0                         # size of the last atom or group (what a quantifier repeats)
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            last = 1
            groups[-1][1] += 1
            continue
        if ch == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "^":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            last = 1
            groups[-1][1] += 1
            continue
        if ch == "(":
            groups.append([0, 0])
            i += 1
            continue
        if ch == ")" and len(groups) > 1:
            done, run = groups.pop()
            last = max(done, run)
            groups[-1][1] += last
            i += 1
            continue
        if ch == "|":
            g = groups[-1]
            g[0], g[1] = max(g[0], g[1]), 0
            i += 1
            continue
        q = _QUANTIFIER.match(pattern, i) if ch == "{" else None
        if q is not None:
            lo, comma, hi = q.groups()
            times = int(hi) if comma and hi else int(lo)
            groups[-1][1] += last * (times - 1)
            last *= times
            i = q.end()
            continue
        last = 1
        groups[-1][1] += 1
        i += 1
    while len(groups) > 1:
        done, run = groups.pop()
        groups[-1][1] += max(done, run)
    return max(groups[0])


def _check_regex(pattern: str, param: str, what: str) -> None:
    size = regex_expansion(pattern)
    if size > MAX_REGEX_EXPANSION:
        raise _too_large(param, f"{what} unrolls to {size:,} characters (each character one, a counted "
                                f"repetition such as {{1000}} that many times); at most {MAX_REGEX_EXPANSION:,} "
                                f"are accepted")
