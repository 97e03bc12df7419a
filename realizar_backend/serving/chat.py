"""Chat completions' answers: a choice's text as OpenAI's message (whole) or its deltas (streamed).

A reply goes through two parsers: the reasoning parser (serving/reasoning.py) takes the thought of
a model whose template thinks apart, as `reasoning_content` (and `reasoning`, vLLM's newer name);
what follows it goes to the tool-call parser (serving/tools.py) when the request has tools, which
takes the calls out as `tool_calls`; the rest is `content`. A tool call the model starts inside its
thought (a call's opening marker before any close tag) ends the thought there and is parsed as a
call. Whole and streamed replies go through the same parsers, so they agree.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from .plans import Plan
from .harmony import HarmonyParser
from .reasoning import HARMONY, ReasoningStreamParser
from .streaming import ChunkTemplate, Last, collect, dumps, finish, stream, usage
from .tools import ToolStreamParser, assemble, delta_chunks, finish_reason


def chat_logprobs(entries) -> list[dict]:
    def one(t, v):
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
    return [{**one(t, lp), "top_logprobs": [one(tt, vv) for tt, vv in top]} for t, lp, top in entries or []]


class ChatReply:
    """One choice's text deltas -> chat deltas: {"reasoning_content": ..., "reasoning": ...},
    {"content": ...} and {"tool_calls": [...]} pieces, in order."""

    def __init__(self, plan: Plan):
        self.tools = None
        self.reasoning = None
        self.harmony = None
        if plan.reasoning is HARMONY:      # gpt-oss: channels carry the thought, the answer and calls
            self.harmony = HarmonyParser(plan.tools if plan.calls_tools else None)
            return
        self.tools = ToolStreamParser(plan.tools) if plan.calls_tools else None
        if plan.reasoning is not None:
            ends = (plan.tools.format.open,) if self.tools is not None and plan.tools.format.open else ()
            self.reasoning = ReasoningStreamParser(plan.reasoning, plan.thinking_inside, ends)

    @property
    def parses(self) -> bool:
        return self.tools is not None or self.reasoning is not None or self.harmony is not None

    @property
    def thinks(self) -> bool:
        """The model's template thinks (the reply's thought is its reasoning)."""
        return self.reasoning is not None or self.harmony is not None

    @property
    def n_calls(self) -> int:
        if self.harmony is not None:
            return self.harmony.n_calls
        return self.tools.n_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> list[dict]:
        if self.harmony is not None:
            return self.harmony.feed(text) + (self.harmony.finish() if final else [])
        out: list[dict] = []
        if self.reasoning is not None:
            r, text = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                r, text = r + r2, text + c2
            if r:
                out.append({"reasoning_content": r, "reasoning": r})
        if self.tools is not None:
            out += self.tools.feed(text) + (self.tools.finish() if final else [])
        elif text:
            out.append({"content": text})
        return out


def _join_deltas(deltas: list[dict]) -> list[dict]:
    """A step's deltas as OpenAI streams them: reasoning pieces joined, then content and tool calls
    joined as delta_chunks joins them."""
    out: list[dict] = []
    rest: list[dict] = []
    for d in deltas:
        if "reasoning" in d:
            out += delta_chunks(rest)
            rest = []
            if out and "reasoning" in out[-1]:
                out[-1] = {k: out[-1][k] + d[k] for k in ("reasoning_content", "reasoning")}
            else:
                out.append(dict(d))
        else:
            rest.append(d)
    return out + delta_chunks(rest)


def message(plan: Plan, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A whole reply as OpenAI's chat message and finish_reason: the thought in reasoning_content
    (and reasoning), tool calls in tool_calls (content null when the reply is only calls, or only
    a thought)."""
    reply = ChatReply(plan)
    if not reply.parses:
        return {"role": "assistant", "content": text}, finish(reason)
    deltas = reply.feed(text, final=True)
    content, calls = assemble([d for d in deltas if "reasoning" not in d])
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reply.thinks:
        thought = "".join(d["reasoning"] for d in deltas if "reasoning" in d)
        thought = thought or None          # no thought, or an empty one
        msg["reasoning_content"] = msg["reasoning"] = thought
        if not content and thought is not None:
            msg["content"] = None
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg, finish_reason(finish(reason), len(calls))


async def full_chat(state, engine, plan: Plan, head) -> AsyncIterator[bytes]:
    got = await collect(engine, plan.jobs)
    choices = []
    for i, text in enumerate(got.texts):
        msg, reason = message(plan, text, got.reasons[i])
        choices.append({"index": i, "message": msg,
                        "logprobs": {"content": chat_logprobs(got.logprobs[i])} if plan.logprobs else None,
                        "finish_reason": reason})
    body = {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(plan.prompt_tokens, sum(got.completion_tokens), plan.cached_tokens(got.cached_tokens))}
    yield Last(await dumps(state, body, sum(map(len, got.texts))))


def stream_chat(engine, plan: Plan, head):
    head = {**head, "object": "chat.completion.chunk"}
    started = [False] * len(plan.jobs)
    replies = [ChatReply(plan) for _ in plan.jobs]
    parses = replies[0].parses if replies else False
    plain = None if parses or plan.continuous_usage else [
        ChunkTemplate(lambda text, i=i: {**head, "choices": [{"index": i, "delta": {"content": text},
                                                              "logprobs": None, "finish_reason": None}]})
        for i in range(len(plan.jobs))]

    def choices(i, out):
        if plain is not None and started[i] and out.finish_reason is None and out.logprobs is None:
            return plain[i](out.text) if out.text else b""
        lp = {"content": chat_logprobs(out.logprobs)} if out.logprobs is not None else None
        reason = finish(out.finish_reason)
        if not parses:
            deltas = [{"content": out.text}] if out.text else []
        else:
            # text becomes reasoning, content and tool_calls deltas as the parsers see them
            r = replies[i]
            deltas = _join_deltas(r.feed(out.text, final=reason is not None))
            reason = finish_reason(reason, r.n_calls)
        if not started[i]:
            started[i] = True      # OpenAI's first delta of a choice names the role
            first = deltas[0] if deltas else {}
            deltas[:1] = [{"role": "assistant", "content": first.get("content", None if parses else ""),
                           **{k: v for k, v in first.items() if k != "content"}}]
        if not deltas and (reason is not None or out.logprobs):
            deltas = [{}]
        return [{"index": i, "delta": d, "logprobs": lp if k == len(deltas) - 1 else None,
                 "finish_reason": reason if k == len(deltas) - 1 else None} for k, d in enumerate(deltas)]
    return stream(engine, plan, head, choices)
