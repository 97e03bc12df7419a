"""What a sequence hands its caller: RequestOutput pieces, the text in them (incremental
detokenization with stop strings held back until they can no longer start one), and how they get
there (the step's Outbox, delivered once per step to each caller's event loop)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .scheduler import Sequence


@dataclass
class RequestOutput:
    request_id: str
    text: str                     # new text since the previous output (stop strings cut)
    token_ids: list[int]          # new token ids
    finish_reason: str | None     # None while running; "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int        # cumulative
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None
    cached_tokens: int = 0        # prompt tokens found in the prefix cache (none were prefilled again)
    stop_string: str | None = None    # the request's stop string that ended the sequence, if one did

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same sequence, as one output: a consumer
        that fell behind takes everything queued in one piece (one SSE chunk, not many)."""
        lp = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(self.request_id, self.text + later.text, self.token_ids + later.token_ids,
                             later.finish_reason, later.prompt_tokens, later.completion_tokens, lp,
                             max(self.cached_tokens, later.cached_tokens), later.stop_string)


def drain_merged(q: asyncio.Queue, item):
    """`item` merged with the outputs already waiting in q, up to the end of the sequence or an
    exception; returns (item, held) where held is an exception (or None) to raise next."""
    while isinstance(item, RequestOutput) and item.finish_reason is None and not q.empty():
        nxt = q.get_nowait()
        if isinstance(nxt, BaseException):
            return item, nxt
        item = item.merged(nxt)
    return item, None


async def queue_outputs(q: asyncio.Queue, start, leave):
    """A sequence's outputs as its caller iterates them (the engine's generate, on a thread or in
    another process): start() queues the sequence at the first iteration (its errors raise
    there), outputs come from q merged as drain_merged merges them until the sequence ends or an
    exception arrives (raised), and leave(done) runs at the end; done is False when the caller
    left early, and the sequence must then be cancelled."""
    start()
    done = False
    held = None
    try:
        while True:
            item = held or await q.get()
            if isinstance(item, BaseException):
                done = True
                raise item
            item, held = drain_merged(q, item)
            if item.finish_reason is not None:
                done = True
            yield item
            if done:
                return
    finally:
        leave(done)


def add_text(seq: Sequence, delta: str) -> tuple[str, bool]:
    """Stop-string handling: returns (text safe to emit, whether a stop string was hit). A stop
    string completed by one of the first min_tokens tokens does not stop the sequence (as the
    stop tokens cannot come among them), and nothing is held back meanwhile."""
    stops = seq.params.stop
    if not stops:
        return delta, False
    pending = seq.pending_text + delta
    if len(seq.output_ids) <= seq.params.min_tokens:
        seq.pending_text = ""
        return pending, False
    # search from where a stop string could start: it may straddle emitted and pending text, but
    # it ends in the pending text (one wholly in the emitted text was passed over by min_tokens)
    longest = max(map(len, stops))
    tail = seq.emitted_text[-(longest - 1):] if longest > 1 else ""
    window = tail + pending
    hits = [(i, s) for s in stops for i in [window.find(s, max(0, len(tail) - len(s) + 1))] if i >= 0]
    if hits:
        at, seq.stop_string = min(hits, key=lambda h: h[0])
        cut = at - len(tail)
        seq.pending_text = ""
        return pending[:max(cut, 0)], True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(window)), 0, -1):
            if window.endswith(s[:k]):
                hold = max(hold, min(k, len(pending)))
                break
    seq.pending_text = pending[len(pending) - hold:] if hold else ""
    return pending[:len(pending) - hold], False


def drain_text(seq: Sequence) -> str:
    """End of a sequence: release what the detokenizer and the stop-string check held back."""
    text, hit = add_text(seq, seq.detok.flush())
    if not hit:
        text += seq.pending_text
    seq.pending_text = ""
    return text


def text_and_stop(seq: Sequence, token: int, stop_ids) -> tuple[str, str | None]:
    """The text that `token`, just appended to the sequence's output, adds for its caller, and the
    reason it ends the sequence ("stop" or "length"; None while it goes on): a stop token of the
    request or, unless ignore_eos, of the model (stop_ids), a stop string, a complete grammar, or
    max_tokens. At the end, whatever was held back is released."""
    p = seq.params
    guide = seq.guide
    # with a grammar, a stop token is drawn only where the grammar is complete: it ends the
    # sequence even with ignore_eos
    stop_tok = token in p.stop_token_ids or (token in stop_ids
                                             and (not p.ignore_eos or guide is not None))
    reason = None
    if stop_tok:
        # the stop token's own text is never shown; whatever was held back is now final
        reason = "stop"
        text = seq.pending_text + seq.detok.flush()
        seq.pending_text = ""
    else:
        text, hit = add_text(seq, seq.detok.add(token))
        if hit:
            reason = "stop"
        elif guide is not None and guide.finished:     # nothing but a stop token could follow
            reason = "stop"
            text += drain_text(seq)
        elif len(seq.output_ids) >= p.max_tokens:
            reason = "length"
            text += drain_text(seq)
    return text, reason


class LoopSink:
    """Where `generate` receives its sequence's outputs: an asyncio queue of the caller's loop."""
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue):
        self.loop, self.queue = loop, q

    def __call__(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


class Outbox:
    """The outputs (and exceptions) of a step, queued for their callers' sinks (a LoopSink, or a
    callable such as a queue's put) on the step thread and delivered together by `flush`."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any]] = []     # (sink, output) of this step

    def emit(self, sink, item: Any) -> None:
        self.items.append((sink, item))

    def flush(self) -> None:
        """Deliver the queued outputs, in order: one wakeup per event loop for all of its streams.
        A wakeup per token would be a write to the loop's self-pipe each, and each write hands the
        GIL to the loop thread, which the step thread then waits to get back: milliseconds per
        step at 64 streams."""
        if not self.items:
            return
        out, self.items = self.items, []
        by_loop: dict[Any, list] = {}
        by_channel: dict[Any, list] = {}
        for sink, item in out:
            if isinstance(sink, LoopSink):
                by_loop.setdefault(sink.loop, []).append((sink.queue, item))
            elif hasattr(sink, "channel"):      # engine/process.py: one message a step for the server
                by_channel.setdefault(sink.channel, []).append((sink.request_id, item))
            else:
                sink(item)
        for channel, records in by_channel.items():
            channel.put(records)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:    # the callers' event loop is closed: they are gone, their aborts queued
                pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class ChannelSink:
    """A sequence's sink in an engine process: its outputs go to its front end through a channel (any
    object with put(records): engine/process.py's, engine/shared.py's per connection)."""
    __slots__ = ("channel", "request_id")

    def __init__(self, channel, request_id: str):
        self.channel, self.request_id = channel, request_id

    def __call__(self, item) -> None:
        self.channel.put([(self.request_id, item)])


class RelayObserver:
    """An engine process's observer: the metrics events (a finished request, a token interval)
    and the step reports it makes go to its front end, whose Metrics get the same calls, later.
    event(ev) queues an event to leave with the next outputs; report(stats) sends a report."""
    __slots__ = ("event", "report")

    def __init__(self, event, report):
        self.event, self.report = event, report

    def on_request_finished(self, *args) -> None:
        self.event(("finished", args))

    def on_token_interval(self, seconds: float) -> None:
        self.event(("interval", seconds))

    def on_step(self, stats) -> None:
        self.report(stats)
