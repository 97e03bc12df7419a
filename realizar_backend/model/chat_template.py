"""Chat templates: rendered as transformers renders them, but never in the server's own process.

A GGUF file can carry any Jinja, and the jinja2 sandbox only stops attribute escapes: a template
can loop for ever, recurse, or build a string of gigabytes. So every render runs in a small worker
process (`python -c` importing only this module and jinja2) that the caller can abandon:
- a wall-clock limit: the caller stops waiting and kills the worker (a fresh one starts on a
  thread; the pool of workers is realizar_backend/childproc.py's ChildPool);
- an output limit: the render is consumed chunk by chunk and stopped past `max_chars`;
- a memory limit: the worker's address space is capped (RLIMIT_AS), so a runaway allocation is a
  MemoryError there instead of swap here.
The environment inside is set up as transformers sets it up (same globals, filters and options),
so the prompt string is the one transformers would build.

`TemplateRenderer.check` compiles and trial-renders a template at load, so a template that does
not parse, that runs away (a loop, a recursion, a huge string) on a plain conversation, or that
fails on every small conversation tried is refused with the model, not per request.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from ..childproc import RESTART, ChildGone, ChildPool, ParentChannel
from ..errors import ChatTemplateError

log = logging.getLogger(__name__)

MAX_TEMPLATE_CHARS = 1 << 20   # the template's own source; real ones are a few kB
_START_TIMEOUT_S = 60.0        # a fresh worker imports jinja2; slow only on a starved machine
TRIAL_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": "Hi! How can I help?"},
                  {"role": "user", "content": "Tell me a joke."}]


@dataclass(frozen=True)
class TemplateLimits:
    timeout_s: float
    max_chars: int
    memory_mb: int
    workers: int

    @classmethod
    def from_settings(cls, settings) -> "TemplateLimits":
        return cls(settings.chat_template_timeout_s, settings.chat_template_max_chars,
                   settings.chat_template_memory_mb, settings.chat_template_workers)


# ---------------------------------------------------------------------- context preparation
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(message: dict) -> dict:
    # Templates read reasoning under different names; fill them all from whichever was given.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types: the sandbox does not know which methods of a
    rich object are dangerous, so none reach the template (and the inputs cross a pipe as JSON)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return plain(value.item())
    if callable(getattr(value, "model_dump", None)):   # pydantic models (the OpenAI schemas)
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


# ---------------------------------------------------------------------- the parent side
def is_harmony(chat_template: str | None) -> bool:
    """The template speaks OpenAI's harmony format (gpt-oss): its messages are spelled in channel
    markers, which the tokenizer keeps in decoded text and the serving layer parses
    (serving/harmony.py)."""
    return bool(chat_template) and "<|channel|>" in chat_template and "<|message|>" in chat_template


class TemplateRenderer:
    """A pool of render workers with one set of limits. Renders are blocking calls (run them off
    the event loop); up to `limits.workers` run at once, the rest wait for a free worker."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.pool = ChildPool(__name__, limits.workers, args=(str(limits.max_chars), str(limits.memory_mb)),
                              start_timeout_s=_START_TIMEOUT_S, unavailable=_unavailable, name="template-worker")

    def render(self, source: str, context: dict[str, Any]) -> str:
        """The template rendered with `context` (plain JSON values); raises ChatTemplateError."""
        try:
            reply = self.pool.call({"template": source, "context": context}, self.limits.timeout_s)
        except TimeoutError:
            raise ChatTemplateError("limit", f"the chat template did not finish within "
                                             f"{self.limits.timeout_s:g} s") from None
        except ChildGone:
            raise ChatTemplateError("unavailable", "the chat template worker process exited") from None
        if "ok" in reply:
            return reply["ok"]
        raise ChatTemplateError(reply["error"], reply["message"])

    def check(self, source: str, special_tokens: Mapping[str, str]) -> None:
        """Compile and render the template on a plain conversation, within the limits; a template
        that refuses it (raise_exception: no system message, say) gets one user message instead,
        and raises only when it fails on that too."""
        for messages in (TRIAL_MESSAGES, TRIAL_MESSAGES[1:2]):
            context = {"messages": messages, "tools": None, "documents": None,
                       "add_generation_prompt": True, **special_tokens}
            try:
                self.render(source, context)
                break
            except ChatTemplateError as e:
                if e.kind != "render" or messages is not TRIAL_MESSAGES:
                    raise
        # the other workers start beside the rest of the load, not before the check returns
        self.pool.prestart()

    def prestart(self) -> None:
        """Start one worker now, on a thread, if none is up: a new process takes 0.1-0.3 s to come
        up, which a model load spends building the vocabulary meanwhile, so that the check after
        the build only renders. A render that comes first waits for this worker."""
        self.pool.prestart(1)

    def close(self) -> None:
        self.pool.close()


def _unavailable(why: str) -> ChatTemplateError:
    if why == "closed":
        return ChatTemplateError("unavailable", "the chat template renderer is closed")
    return ChatTemplateError("unavailable", f"the chat template worker process {why}")


_renderers: dict[TemplateLimits, TemplateRenderer] = {}
_renderers_lock = threading.Lock()


def renderer(limits: TemplateLimits) -> TemplateRenderer:
    """The process's renderer for these limits (tokenizers of one server share its workers)."""
    with _renderers_lock:
        r = _renderers.get(limits)
        if r is None:
            r = _renderers[limits] = TemplateRenderer(limits)
        return r


# ---------------------------------------------------------------------- the worker side
def worker_main(argv: list[str]) -> None:
    """The render loop of a worker process: requests from the server until the end of its input."""
    import resource

    max_chars, memory_mb = int(argv[0]), int(argv[1])
    parent = ParentChannel()
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from . import jinja_env   # imported after the limit: its cost counts against it too

    env = jinja_env.make_environment()
    compiled: dict[str, Any] = {}
    parent.reply({"ready": True})
    for req in parent.requests():
        try:
            parent.reply({"ok": jinja_env.render(env, compiled, req["template"], req["context"], max_chars)})
        except MemoryError:
            compiled.clear()
            parent.reply({"error": "limit", RESTART: True,
                          "message": f"the chat template needed more than {memory_mb} MB of memory"})
        except ChatTemplateError as e:
            parent.reply({"error": e.kind, "message": e.message})
        except RecursionError:      # a runaway (a macro calling itself), as a loop past the time limit is
            parent.reply({"error": "limit", "message": "the chat template recursed too deeply"})
        except Exception as e:  # anything a template can raise on some input is that render's failure
            parent.reply({"error": "render", "message": f"{type(e).__name__}: {e}"})
