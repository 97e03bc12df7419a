"""Reasoning ("thinking") in a model's reply: the text of its thought apart from its answer.

Models whose chat template thinks (Qwen3, Qwen3.5, QwQ, DeepSeek-R1 and their kind) write
`<think> ... </think>` before the answer, or start inside the thought when the template's
generation prompt opened it (`<|im_start|>assistant\\n<think>\\n`). The APIs return the thought
apart: OpenAI chat's `reasoning_content` (and `reasoning`), Anthropic's thinking blocks, the
Responses API's reasoning items. The format is read from the chat template, never from a model's
name.

The interface (stable: the other APIs' routes use it):

    fmt = detect_reasoning(chat_template)          # ReasoningFormat, or None: the model does not think
    inside = fmt.opened_by(prompt_text)            # the rendered prompt left the model inside a thought
    reasoning, content = split_reasoning(fmt, text, inside)         # a whole reply
    p = ReasoningStreamParser(fmt, inside)         # a streamed reply, fed its text deltas:
    for delta in deltas:
        r, c = p.feed(delta)                       # (reasoning_delta, content_delta), either may be ""
    r, c = p.finish()                              # what was held back, at the end of the reply
    p.saw_reasoning                                # the reply had a thought (even an empty one)

    # the engine's view of the thought (engine/token_rules.py), for a request's SamplingParams:
    params.thinking = engine_thinking(fmt, tokenizer, max_tokens=budget)   # budget: None = no limit
    ids = engine.prepare(..., params, messages, ...)   # renders the prompt, sets params.thinking.inside
    inside = params.thinking.inside

Rules (the same whole or streamed, however the text is split):
- a thought is recognised only at the start of the reply (leading whitespace aside), or from the
  first character when `inside`; a reply that does not open one is all content, unchanged;
- the thought ends at the close tag, or at one of `ends` (markers that begin the answer without
  closing the thought, such as a tool call's `<tool_call>`: a model asked for a call while its
  template opened a thought writes one there); such a marker stays in the content;
- whitespace around the thought's text and between the thought and the answer is dropped;
- a thought that never closes (the reply was cut short) is all reasoning, and the content is "".
split_reasoning's reasoning is None when the reply had no thought.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.token_rules import Thinking
from ..model.chat_template import is_harmony


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    open: str        # the tag that opens a thought
    close: str       # the tag that closes it

    def opened_by(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves the model inside a thought: its last open tag comes
        after its last close tag (a generation prompt that ends `<think>\\n`). A prompt whose
        thought is closed (Qwen3's `<think>\\n\\n</think>` when thinking is off) does not."""
        return prompt.rfind(self.open) > prompt.rfind(self.close)


THINK = ReasoningFormat("think", "<think>", "</think>")
# gpt-oss's harmony format: the thought is the analysis channel's message. Its replies are parsed by
# harmony.py (chat.ChatReply picks that parser), not by ReasoningStreamParser; the engine gets no
# Thinking for it (no thought budget).
HARMONY = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>")
_FORMATS = (THINK,)


def detect_reasoning(chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template writes (it spells both tags, in its generation prompt
    or where it renders past assistant turns), or None when it has none."""
    if not chat_template:
        return None
    if is_harmony(chat_template):
        return HARMONY
    for fmt in _FORMATS:
        if fmt.open in chat_template and fmt.close in chat_template:
            return fmt
    return None


def engine_thinking(fmt: ReasoningFormat, tokenizer, max_tokens: int | None = None) -> Thinking:
    """The engine's view of a thought in this format (its tags' token ids by `tokenizer`), with a
    budget of max_tokens thought tokens before the close tag is forced (None: no limit). Set it as
    SamplingParams.thinking; RequestPrep.prepare then sets its `inside` from the rendered prompt."""
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    return Thinking(fmt.open, fmt.close, ids(fmt.open), ids(fmt.close), max_tokens)


def split_reasoning(fmt: ReasoningFormat, text: str, inside: bool = False,
                    ends: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """A whole reply -> (reasoning, content); reasoning is None when the reply had no thought."""
    p = ReasoningStreamParser(fmt, inside, ends)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.saw_reasoning else None), c1 + c2


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text may be the start of one of the markers."""
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), hold, -1):
            if m.startswith(text[-k:]):
                hold = k
                break
    return hold


class ReasoningStreamParser:
    """A reply's text deltas -> (reasoning_delta, content_delta) pairs; see the module's rules.

    inside: the prompt left the model inside a thought (ReasoningFormat.opened_by).
    ends: markers that end a thought and begin the content (kept in it), e.g. a tool call's opener."""

    def __init__(self, fmt: ReasoningFormat, inside: bool = False, ends: tuple[str, ...] = ()):
        self.fmt = fmt
        self.ends = tuple(e for e in ends if e)
        self.saw_reasoning = inside
        # start: nothing but whitespace yet (a thought may still open) | think | after: the thought
        # closed, whitespace before the answer is dropped | content: passed through
        self._mode = "think" if inside else "start"
        self._buf = ""
        self._held_ws = ""         # whitespace inside the thought, kept until more thought follows
        self._thought_text = False  # the thought has had text (its leading whitespace is dropped)

    @property
    def in_reasoning(self) -> bool:
        """The reply is inside a thought now (what the next text will be, as far as known)."""
        return self._mode == "think"

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            if self._mode == "start":
                rest = self._buf.lstrip()
                if rest.startswith(self.fmt.open):
                    self._buf = rest[len(self.fmt.open):]
                    self._mode, self.saw_reasoning = "think", True
                    continue
                if not final and (not rest or self.fmt.open.startswith(rest)):
                    break                   # may still become the open tag
                self._mode = "content"      # no thought: the reply is content, unchanged
                continue
            if self._mode == "think":
                close = self.fmt.close
                hits = [(i, m) for m in (close, *self.ends) for i in [self._buf.find(m)] if i >= 0]
                if hits:
                    at, marker = min(hits)
                    self._thought(self._buf[:at], reasoning, closing=True)
                    self._buf = self._buf[at + len(close):] if marker == close else self._buf[at:]
                    self._mode = "after"
                    continue
                keep = 0 if final else partial_tail(self._buf, (close, *self.ends))
                self._thought(self._buf[:len(self._buf) - keep], reasoning, closing=final)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._mode == "after":
                rest = self._buf.lstrip()
                self._buf = rest
                if rest:
                    self._mode = "content"
                continue
            content.append(self._buf)
            self._buf = ""
        if final and self._buf:            # a start that was only whitespace or part of the tag
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def _thought(self, text: str, out: list[str], closing: bool) -> None:
        """Text of the thought: its leading whitespace dropped, trailing whitespace held until
        more of the thought follows (dropped when the thought ends)."""
        if not self._thought_text:
            text = text.lstrip()
            if not text:
                return
            self._thought_text = True
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = "" if closing else text[len(body):]
        if body:
            out.append(body)

