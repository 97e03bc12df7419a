"""Chat request fields that shape the prompt and the thought, checked (400s naming the field):

- `chat_template_kwargs` (vLLM's): more variables for the chat template, such as Qwen3's
  `enable_thinking`: an object of JSON values, bounded in size, whose keys are names a template
  can read and not the template's own variables (messages, tools, add_generation_prompt, the
  special tokens, ...), which the request sets through their own fields;
- `reasoning_effort` (OpenAI's): one of REASONING_EFFORTS, passed to the template as
  `reasoning_effort` (templates that read it, such as gpt-oss's, set their effort from it);
- `add_generation_prompt` and `continue_final_message` (vLLM's; not both true): open a new
  assistant turn (the default), or leave the final message open for the model to go on writing it
  (then add_generation_prompt defaults to false);
- `max_reasoning_tokens`: for a model whose template thinks, the most tokens its thought may take
  before the engine forces the thought's close tag (engine/token_rules.py).

`ChatOptions` carries them to RequestPrep.prepare (template kwargs and flags) and to the plan.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..engine.token_rules import Thinking
from ..errors import RequestError
from .reasoning import HARMONY, ReasoningFormat, detect_reasoning, engine_thinking

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10     # the kwargs' JSON text: plenty for flags and a few documents
MAX_TEMPLATE_KWARGS = 64                 # keys
# variables the template gets from the request's own fields or from the renderer (the special
# tokens, transformers' globals): a kwarg of the same name would replace them
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
    "tokenize", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "raise_exception", "strftime_now", "namespace", "dict", "range", "loop", "self"})
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def _bad(param: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code=code)


@dataclass
class ChatOptions:
    """What a chat request asks of the template and of the thought."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning: ReasoningFormat | None = None     # the model's reasoning format (None: it does not think)
    thinking: Thinking | None = None             # the engine's view of it (ids, budget)


def template_kwargs(value: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(param, "expected an object", "invalid_type")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise _bad(param, f"at most {MAX_TEMPLATE_KWARGS} keys, got {len(value)}")
    for key in value:
        if not _NAME.match(key):
            raise _bad(param, f"{key[:40]!r} is not a template variable name (letters, digits, underscores)")
        if key in RESERVED_TEMPLATE_NAMES:
            raise _bad(param, f"{key!r} is set by the request or the server, not by chat_template_kwargs"
                              + (" (use the request's own field)" if key in ("messages", "tools", "documents",
                                                                             "add_generation_prompt",
                                                                             "continue_final_message") else ""))
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise _bad(param, f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON, got {size}")
    return value


def _flag(data: dict, name: str, default: bool) -> bool:
    v = data.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "expected a boolean", "invalid_type")
    return v


def chat_options(data: dict, tokenizer) -> ChatOptions:
    """A chat request body's template and reasoning fields, checked; tokenizer: the model's (its
    chat template says whether and how the model thinks; the thought's tags are encoded with it)."""
    kwargs = dict(template_kwargs(data.get("chat_template_kwargs")))
    effort = data.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise _bad("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
        kwargs.setdefault("reasoning_effort", effort)
    cont = _flag(data, "continue_final_message", False)
    gen = _flag(data, "add_generation_prompt", not cont)
    if gen and cont:
        raise _bad("continue_final_message", "cannot be combined with add_generation_prompt (set it to false)")
    fmt = detect_reasoning(tokenizer.chat_template)
    budget = data.get("max_reasoning_tokens")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= 1 << 30:
            raise _bad("max_reasoning_tokens", "expected an integer from 0", "invalid_type")
        if fmt is None:
            raise _bad("max_reasoning_tokens", "this model's chat template does not think (no <think> tags)",
                       "unsupported_parameter")
        if fmt is HARMONY:
            raise _bad("max_reasoning_tokens", "not supported for this model's harmony (gpt-oss) format; "
                       "use reasoning_effort", "unsupported_parameter")
    thinking = engine_thinking(fmt, tokenizer, budget) if fmt is not None and fmt is not HARMONY else None
    return ChatOptions(kwargs, gen, cont, fmt, thinking)
