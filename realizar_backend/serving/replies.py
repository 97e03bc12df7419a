"""A chat reply read back for the APIs that answer in typed parts (Anthropic's content blocks, the
Responses API's output items): the engine's text deltas become events, in order,

    ("reasoning", piece)                the model's thought (a model whose template thinks)
    ("text", piece)                     answer text
    ("call", index, call_id, name)      a tool call starts (index counts the reply's calls)
    ("args", index, piece)              the call's arguments: pieces of the model's JSON text

The reply goes through chat completions' own parsers (chat.ChatReply: the thought by
reasoning.py's parser, then the tool calls by tools.ToolStreamParser), so a reply is split the
same way by every API, streamed or whole, however its text was cut. A plan here is anything with
chat.ChatReply's fields: tools, calls_tools, reasoning and thinking_inside.
`Reply` joins a reply's events into its parts, which is what a whole (non-streamed) answer lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .chat import ChatReply


class ReplyReader:
    """Text deltas -> events (see the module); finish() at the end of the reply."""

    def __init__(self, plan):
        self._chat = ChatReply(plan)

    @property
    def calls(self) -> int:
        return self._chat.n_calls

    def feed(self, text: str) -> list[tuple]:
        return _events(self._chat.feed(text))

    def finish(self) -> list[tuple]:
        return _events(self._chat.feed("", final=True))


def _events(deltas: list[dict]) -> list[tuple]:
    out: list[tuple] = []
    for d in deltas:
        if d.get("reasoning_content"):
            out.append(("reasoning", d["reasoning_content"]))
        if d.get("content"):
            out.append(("text", d["content"]))
        for tc in d.get("tool_calls", ()):
            if "id" in tc:
                out.append(("call", tc["index"], tc["id"], tc["function"]["name"]))
            if tc["function"]["arguments"]:
                out.append(("args", tc["index"], tc["function"]["arguments"]))
    return out


@dataclass
class Part:
    kind: str                   # reasoning | text | call
    text: str = ""              # text: the text; call: the arguments' JSON text
    call_id: str = ""
    name: str = ""


@dataclass
class Reply:
    """A reply's parts, in order, joined from its events: consecutive pieces of one kind make
    one part, each tool call is a part."""
    parts: list[Part] = field(default_factory=list)

    def add(self, events: list[tuple]) -> None:
        for ev in events:
            kind = ev[0]
            if kind == "call":
                self.parts.append(Part("call", "", ev[2], ev[3]))
            elif kind == "args":
                self.parts[-1].text += ev[2]
            elif self.parts and self.parts[-1].kind == kind:
                self.parts[-1].text += ev[1]
            else:
                self.parts.append(Part(kind, ev[1]))

    @property
    def calls(self) -> list[Part]:
        return [p for p in self.parts if p.kind == "call"]


def read_whole(text: str, plan) -> Reply:
    """A whole reply's parts (what its streamed events add up to)."""
    reader = ReplyReader(plan)
    reply = Reply()
    reply.add(reader.feed(text) + reader.finish())
    return reply
