"""OpenAI's "harmony" reply format (gpt-oss): a reply is a sequence of messages on channels.

    <|channel|>analysis<|message|>...the thought...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

and a tool call is a message on the commentary channel addressed to a function:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(the recipient may also stand before the channel: `<|start|>assistant to=functions.x<|channel|>
commentary json<|message|>...`). The format is recognised from the chat template (it spells
`<|channel|>` and `<|message|>`), never from a model's name; reasoning.detect_reasoning answers
HARMONY for such a template and tools.detect_format answers tools.HARMONY.

The markers are special tokens of gpt-oss's vocabulary; the tokenizer keeps them in the decoded
text of a model whose template is harmony (model/tokenizer.py), so that this parser sees them. It
turns a reply's text deltas into chat deltas, the same vocabulary as chat.ChatReply's:
- the analysis channel -> {"reasoning_content": ..., "reasoning": ...};
- the final channel, commentary without a recipient (a preamble to the user), and a reply that
  does not open with a channel (plain text) -> {"content": ...};
- a message to `functions.NAME` (NAME one of the request's tools) -> {"tool_calls": [...]}: the
  call's index, id, type and name when its body starts, then its arguments (the body, the model's
  JSON text) as they arrive; a message to another recipient is reasoning (not for the user).
The markers never reach the content. Whitespace around a message's text is dropped. A reply cut
short keeps what was written: an open thought is reasoning, an open call keeps its arguments so far.
The same text gives the same result whole or streamed, however it is split.
"""

from __future__ import annotations

import re

from .reasoning import partial_tail
from .tools import ToolCall, ToolRequest

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
# what ends a message's body (a model may omit <|end|> before the next <|start|>)
_BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
_HEADER_OPENERS = (START, CHANNEL, "to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyParser:
    """A harmony reply's text deltas -> chat deltas (see the module). req: the request's tools
    (None or tool_choice none: no calls; a message to a function is then reasoning)."""

    def __init__(self, req: ToolRequest | None = None):
        self.req = req if req is not None and req.choice != "none" else None
        self.n_calls = 0
        self.saw_reasoning = False
        self._buf = ""
        self._mode = "between"       # between (no message open) | header | body | plain
        self._header = ""
        self._kind = ""              # the open body's kind: reasoning | content | call
        self._started = False        # the open body has had text (its leading whitespace is dropped)
        self._held = ""              # trailing whitespace of the open body, until more text follows
        self._call: ToolCall | None = None
        self._args = ""

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[dict]:
        return self._run(final=True)

    # ------------------------------------------------------------------ the reply's states
    def _run(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._mode == "between":
                rest = self._buf.lstrip()
                if not rest:
                    self._buf = ""
                    return out
                if rest.startswith(START):
                    self._buf, self._header, self._mode = rest[len(START):], "", "header"
                    continue
                if rest.startswith(CHANNEL) or rest.startswith("to="):
                    self._buf, self._header, self._mode = rest, "", "header"
                    continue
                if not final and any(o.startswith(rest) for o in _HEADER_OPENERS):
                    return out            # may still open a message
                self._open("content")     # text outside any message: plain content
                self._mode = "plain"
                continue
            if self._mode == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final:             # cut short in a header: nothing of it is text
                        self._buf = ""
                        return out
                    return out
                self._header += self._buf[:at]
                self._buf = self._buf[at + len(MESSAGE):]
                self._begin(self._header, out)
                self._mode = "body"
                continue
            # body or plain: text up to the first marker that ends it
            hits = [(i, m) for m in _BODY_ENDS for i in [self._buf.find(m)] if i >= 0]
            if hits:
                at, marker = min(hits)
                self._text(self._buf[:at], out, closing=True)
                self._buf = self._buf[at:]
                if marker in (END, RETURN, CALL):
                    self._buf = self._buf[len(marker):]
                self._close(out)
                self._mode = "between"
                continue
            keep = 0 if final else partial_tail(self._buf, _BODY_ENDS)
            self._text(self._buf[:len(self._buf) - keep], out, closing=final)
            self._buf = self._buf[len(self._buf) - keep:]
            if final:
                self._close(out)
                self._mode = "between"
            return out

    def _begin(self, header: str, out: list[dict]) -> None:
        """A message's header read (`<|channel|>NAME [to=RECIPIENT] [<|constrain|>json]`)."""
        m = _CHANNEL_NAME.search(header)
        channel = m.group(1) if m else ""
        r = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        recipient = r.group(1) if r else None
        if recipient is not None:
            name = recipient[len("functions."):] if recipient.startswith("functions.") else None
            if self.req is not None and name is not None and name in self.req.functions:
                self._open("call")
                self._call = ToolCall(name, "")
                out.append({"tool_calls": [{"index": self.n_calls, "id": self._call.id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
                return
            self._open("reasoning")      # a message to someone else: not for the user
        elif channel == "analysis":
            self._open("reasoning")
        else:
            self._open("content")        # final, a commentary preamble, or a channel we do not know
        if self._kind == "reasoning":
            self.saw_reasoning = True

    def _open(self, kind: str) -> None:
        self._kind, self._started, self._held, self._args = kind, False, "", ""

    def _text(self, text: str, out: list[dict], closing: bool) -> None:
        """Text of the open body: leading whitespace dropped, trailing whitespace held until more
        text follows (dropped at the body's end)."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = "" if closing else text[len(body):]
        if not body:
            return
        if self._kind == "reasoning":
            out.append({"reasoning_content": body, "reasoning": body})
        elif self._kind == "content":
            out.append({"content": body})
        else:
            self._args += body
            out.append({"tool_calls": [{"index": self.n_calls, "function": {"arguments": body}}]})

    def _close(self, out: list[dict]) -> None:
        if self._kind == "call" and self._call is not None:
            if not self._args:            # a call without arguments
                out.append({"tool_calls": [{"index": self.n_calls, "function": {"arguments": "{}"}}]})
            self.n_calls += 1
            self._call = None
        self._kind, self._held = "", ""
