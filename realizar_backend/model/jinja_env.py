"""The Jinja environment chat templates render in, set up as transformers sets it up (same
globals, filters and options), and one render with an output limit. It runs inside the render
worker processes of chat_template.py; nothing else should render a model's template."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError

_CACHE_SIZE = 4     # compiled templates kept per worker (one model: one template)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    just emits the body, as transformers does when it is not tracking."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args, **kwargs):  # noqa: N805 (same signature trick as jinja2's Namespace)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot store underscore attributes ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; chat templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env


def compile_template(env: ImmutableSandboxedEnvironment, cache: dict[str, Any], source: str):
    template = cache.get(source)
    if template is None:
        try:
            template = env.from_string(source)
        except (jinja2.TemplateSyntaxError, SyntaxError, RecursionError) as e:
            # SyntaxError: e.g. a break outside a loop; RecursionError: nesting beyond the parser
            raise ChatTemplateError("syntax", f"the chat template does not parse: {e}") from None
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[source] = template
    return template


def render(env: ImmutableSandboxedEnvironment, cache: dict[str, Any], source: str,
           context: dict[str, Any], max_chars: int) -> str:
    """The template rendered with `context`, stopped once its output passes max_chars."""
    template = compile_template(env, cache, source)
    parts, size = [], 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > max_chars:
                raise ChatTemplateError("limit", f"the chat template's output passed {max_chars} characters")
            parts.append(chunk)
    except jinja2.TemplateError as e:
        # raise_exception() in the template (e.g. "roles must alternate"), or a sandbox refusal
        raise ChatTemplateError("render", f"chat template error: {e}") from None
    return "".join(parts)
