"""The engine: an async generate API over a step loop that batches every running sequence.

One background thread owns the backend and runs steps: admit waiting requests into free KV
slots and prefill them (each sequence's first token is drawn here, from the prefill's logits),
then decode every running sequence in one batched call that the backend also samples
(engine/sampling.py defines how), and hand each sequence's new text to its caller. Callers iterate asynchronously (`generate`) or
synchronously (`generate_sync`, for the CLI); leaving the iteration early cancels the
sequence and frees its slot at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Protocol

import numpy as np

from ..backends import Backend, PrefillItem, create_backend, start_device
from ..errors import CapacityError, ContextOverflowError, RequestError
from ..formats import open_model
from ..model.default import default_model_path
from ..settings import Settings
from .sampling import Sampler, SamplingParams, token_logprobs
from .scheduler import Scheduler, Sequence

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    text: str                     # new text since the previous output (stop strings cut)
    token_ids: list[int]          # new token ids
    finish_reason: str | None     # None while running; "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int        # cumulative
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same sequence, as one output: a consumer
        that fell behind takes everything queued in one piece (one SSE chunk, not many)."""
        lp = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(self.request_id, self.text + later.text, self.token_ids + later.token_ids,
                             later.finish_reason, later.prompt_tokens, later.completion_tokens, lp)


def drain_merged(q: asyncio.Queue, item):
    """`item` merged with the outputs already waiting in q, up to the end of the sequence or an
    exception; returns (item, held) where held is an exception (or None) to raise next."""
    while isinstance(item, RequestOutput) and item.finish_reason is None and not q.empty():
        nxt = q.get_nowait()
        if isinstance(nxt, BaseException):
            return item, nxt
        item = item.merged(nxt)
    return item, None


class EngineObserver(Protocol):
    def on_request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                            e2e_s: float, ttft_s: float | None) -> None: ...

    def on_token_interval(self, seconds: float) -> None: ...

    def on_step(self, stats: dict[str, Any]) -> None: ...


class NullObserver:
    def on_request_finished(self, *a, **k) -> None:
        pass

    def on_token_interval(self, seconds: float) -> None:
        pass

    def on_step(self, stats: dict[str, Any]) -> None:
        pass


class Engine:
    def __init__(self, backend: Backend, tokenizer, settings: Settings | None = None,
                 model_name: str = "model", observer: EngineObserver | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.settings = settings or Settings()
        self.config = backend.config
        self.model_name = model_name
        self.observer = observer or NullObserver()
        self.max_context = backend.max_context
        self.scheduler = Scheduler(backend.max_slots, backend.max_context, self.settings.max_waiting)
        self._stop = False
        self._closing: str | None = None      # finish_all(reason): end everything, take nothing new
        self._decode_window: list[tuple[float, int]] = []   # (time, tokens) of recent decode steps
        self._ahead: tuple[list[Sequence], Any] | None = None  # a greedy step started ahead (_greedy_step)
        self._last_shape: tuple[int, int] = (-1, -1)
        self._last_report = 0.0
        self._thread = threading.Thread(target=self._loop, name="realizar-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, settings: Settings | None = None, observer: EngineObserver | None = None) -> "Engine":
        from ..model.chat_template import TemplateLimits
        from ..model.tokenizer import Tokenizer
        settings = settings or Settings.from_env()
        path = Path(settings.model) if settings.model else default_model_path()
        t0 = time.perf_counter()
        start_device(settings)
        model = open_model(path)
        # the tokenizer (a vocabulary of 150k+ entries: ~0.5 s) builds while the backend starts
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tok = pool.submit(Tokenizer.from_model_file, model, TemplateLimits.from_settings(settings))
            backend = create_backend(model, settings)
            try:
                tokenizer = tok.result()
            except BaseException:
                backend.close()
                raise
        name = settings.model_name or (model.name if settings.model else "SmolLM2-135M-Instruct")
        log.info("loaded %s (%s, %s backend) in %.1f s", name, model.config.arch, backend.name,
                 time.perf_counter() - t0)
        return cls(backend, tokenizer, settings, model_name=name, observer=observer)

    # ------------------------------------------------------------------ request side

    def prepare(self, prompt: str | list[int] | None, params: SamplingParams,
                messages: list[dict] | None = None) -> list[int]:
        """Tokenize and validate a request; fills params.max_tokens when it is None.
        Raises RequestError / ContextOverflowError before anything is queued."""
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False, limit=self.max_context)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True, limit=self.max_context)
        elif isinstance(prompt, list):
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        params.validate(self.config.vocab_size)
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextOverflowError(f"prompt has {len(ids)} tokens; this server's context is "
                                       f"{self.max_context} tokens", param="prompt")
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ContextOverflowError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                       f"exceeds this server's context of {self.max_context} tokens")
        return ids

    def _new_sequence(self, ids: list[int], params: SamplingParams, request_id: str | None, sink) -> Sequence:
        if self._closing is not None:
            raise CapacityError("the server is shutting down; retry on another replica", retry_after_s=5)
        if params.max_tokens is None or len(ids) + params.max_tokens > self.max_context:
            raise ContextOverflowError(f"prompt plus max_tokens exceeds the context of {self.max_context}")
        return Sequence(request_id=request_id or uuid.uuid4().hex, prompt_ids=list(ids), params=params,
                        sampler=Sampler(params, ids, self.config.vocab_size), sink=sink,
                        detok=self.tokenizer.detokenizer(ids))

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        seq = self._new_sequence(prompt_ids, params, request_id,
                                 lambda item: loop.call_soon_threadsafe(q.put_nowait, item))
        self.scheduler.submit(seq)
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
            if not done:
                self.scheduler.abort(seq.request_id)

    def generate_sync(self, prompt_ids: list[int], params: SamplingParams,
                      request_id: str | None = None) -> Iterator[RequestOutput]:
        q: queue.Queue = queue.Queue()
        seq = self._new_sequence(prompt_ids, params, request_id, q.put)
        self.scheduler.submit(seq)
        done = False
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
                if done:
                    return
        finally:
            if not done:
                self.scheduler.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        b = self.backend.stats()
        return {
            "backend": self.backend.name,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_usage": s.kv_usage(),
            "decode_tokens_per_s": self._decode_rate(),
            "graph_status": b.get("graph_status", {}),
            "pool_bytes": b.get("pool_bytes", 0),
            "device_memory_bytes": b.get("device_memory_bytes", 0),
            "graph_replays": b.get("graph_replays", 0),
            "graph_captures": b.get("graph_captures", 0),
        }

    def finish_all(self, reason: str = "shutdown") -> None:
        """End every sequence at the next step and take no new ones (a graceful shutdown's
        deadline): a running sequence gets a final output with `reason` as its finish_reason and
        the text held back for stop strings; a waiting one, which produced nothing yet, fails with
        CapacityError so that its client may retry elsewhere."""
        with self.scheduler.wakeup:
            self._closing = reason
            self.scheduler.wakeup.notify()

    def shutdown(self) -> None:
        with self.scheduler.wakeup:
            self._stop = True
            self.scheduler.wakeup.notify()
        self._thread.join(timeout=10)
        self.backend.close()

    # ------------------------------------------------------------------ step loop (one thread)

    def _loop(self) -> None:
        sch = self.scheduler
        while True:
            with sch.wakeup:
                while not self._stop and not sch.has_work():
                    sch.wakeup.wait()
                if self._stop:
                    break
            try:
                self._step()
            except Exception as e:  # a backend failure must not kill the loop or the others' streams
                log.exception("engine step failed; failing the running requests")
                self._ahead = None
                for seq in list(sch.running):
                    seq.finish_reason = "error"
                    self.backend.release(seq.slot)
                    sch.remove(seq)
                    seq.sink(e)
            # gauges: on every change of the batch's make-up, else at most every 50 ms, so that a
            # fast GPU step does not pay for a stats() call per token
            shape = (len(sch.running), len(sch.waiting))
            now = time.perf_counter()
            if shape != self._last_shape or now - self._last_report >= 0.05:
                self._last_shape, self._last_report = shape, now
                self.observer.on_step(self.stats())

    def _step(self) -> None:
        sch = self.scheduler
        if self._closing is not None:
            self._end_all(self._closing)
            return
        for rid in sch.take_aborts():
            seq = sch.find(rid)
            if seq is not None:
                self._finish(seq, "abort")
        new = sch.admit()
        if new:
            logits = self.backend.prefill([PrefillItem(s.slot, np.asarray(s.prompt_ids, dtype=np.int32), 0)
                                           for s in new])
            for seq, row in zip(new, logits):
                if seq.sampler.needs_counts:
                    self.backend.reset_counts(seq.slot, np.asarray(seq.prompt_ids, dtype=np.int32))
                self._accept(seq, row, None)    # the first token: drawn here by the twin
        batch = [s for s in sch.running if not s.finished and s not in new]
        if not batch:
            self._drop_ahead()
            return
        slots = [s.slot for s in batch]
        toks = [s.output_ids[-1] for s in batch]
        pos = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in batch]
        if all(s.params.greedy and not s.sampler.needs_counts and s.params.logprobs is None for s in batch):
            ids = self._greedy_step(batch, slots, toks, pos)
            for seq, tok in zip(batch, ids):
                self._accept(seq, None, int(tok))
        else:
            self._drop_ahead()
            # sampled by the backend; only rows asking for top logprobs beyond one get logits back
            rows = [s.sampler.row(step=len(s.output_ids), logprobs=s.params.logprobs in (0, 1),
                                  want_logits=(s.params.logprobs or 0) > 1) for s in batch]
            res = self.backend.decode_sample(slots, toks, pos, rows)
            for i, seq in enumerate(batch):
                lp = None
                if seq.params.logprobs in (0, 1):
                    top = [(int(res.top_ids[i]), float(res.top_logprobs[i]))] if seq.params.logprobs else []
                    lp = (float(res.logprobs[i]), top)
                self._accept(seq, res.logits.get(i), int(res.tokens[i]), lp)
        self._decode_window.append((time.perf_counter(), len(batch)))
        del self._decode_window[:-64]

    def _end_all(self, reason: str) -> None:
        self._drop_ahead()
        for seq in list(self.scheduler.running):
            text = self._drain(seq)
            seq.emitted_text += text
            seq.sink(RequestOutput(seq.request_id, text, [], reason, len(seq.prompt_ids), len(seq.output_ids)))
            self._finish(seq, reason, notify=False)
        for seq in list(self.scheduler.waiting):
            seq.sink(CapacityError("the server is shutting down; retry on another replica", retry_after_s=5))
            self._finish(seq, reason, notify=False)
        self.scheduler.take_aborts()

    def _greedy_step(self, batch: list[Sequence], slots: list[int], toks: list[int], pos: list[int]) -> np.ndarray:
        """A greedy step, pipelined: the step after it is started (on the device's own argmax
        tokens) before this one's tokens are read, so the GPU does not wait for the host's per-token
        work. A step started ahead is used when the batch is unchanged (the same sequences in the
        same order), else waited for and dropped: its cache rows are rewritten or never read."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and len(ahead[0]) == len(batch) and all(a is b for a, b in zip(ahead[0], batch)):
            h = ahead[1]
        else:
            if ahead is not None:
                self.backend.decode_argmax_finish(ahead[1])
            h = self.backend.decode_argmax_start(slots, toks, pos)
        # the next step goes ahead unless a sequence must stop after this one (length or context)
        if all(len(s.output_ids) + 1 < s.params.max_tokens and p + 1 < self.backend.max_context
               for s, p in zip(batch, pos)):
            self._ahead = (batch, self.backend.decode_argmax_start(slots))
        return self.backend.decode_argmax_finish(h)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self.backend.decode_argmax_finish(ahead[1])

    def _decode_rate(self) -> float:
        w = self._decode_window
        if len(w) < 2 or time.perf_counter() - w[-1][0] > 2.0:
            return 0.0
        span = w[-1][0] - w[0][0]
        return sum(n for _, n in w[1:]) / span if span > 0 else 0.0

    def _accept(self, seq: Sequence, logits: np.ndarray | None, token: int | None,
                logprobs: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        """Sample (unless the backend already did), then emit and check stop conditions.
        logprobs: (chosen, top) when the backend computed them; else they come from `logits`."""
        p = seq.params
        if token is None:
            token = seq.sampler.sample(logits)
        seq.sampler.observe(token)
        seq.output_ids.append(token)
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        else:
            self.observer.on_token_interval(now - seq.last_token_time)
        seq.last_token_time = now

        lp = None
        if p.logprobs is not None and (logits is not None or logprobs is not None):
            if logprobs is None:
                logprobs = token_logprobs(logits[: self.config.vocab_size], token, p.logprobs)
            chosen, top = logprobs
            tt = self.tokenizer.token_text
            lp = [(tt(token), chosen, [(tt(i), v) for i, v in top])]

        stop_tok = token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.stop_ids)
        reason = None
        if stop_tok:
            # the stop token's own text is never shown; whatever was held back is now final
            reason = "stop"
            text = seq.pending_text + seq.detok.flush()
            seq.pending_text = ""
        else:
            text, hit = self._add_text(seq, seq.detok.add(token))
            if hit:
                reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens:
                reason = "length"
                text += self._drain(seq)
        seq.emitted_text += text
        seq.sink(RequestOutput(seq.request_id, text, [token], reason, len(seq.prompt_ids),
                               len(seq.output_ids), lp))
        if reason is not None:
            self._finish(seq, reason, notify=False)

    def _drain(self, seq: Sequence) -> str:
        """End of a sequence: release what the detokenizer and the stop-string check held back."""
        text, hit = self._add_text(seq, seq.detok.flush())
        if not hit:
            text += seq.pending_text
        seq.pending_text = ""
        return text

    def _add_text(self, seq: Sequence, delta: str) -> tuple[str, bool]:
        """Stop-string handling: returns (text safe to emit, whether a stop string was hit)."""
        stops = seq.params.stop
        if not stops:
            return delta, False
        pending = seq.pending_text + delta
        # search from where a stop string could start: it may straddle emitted and pending text
        tail = seq.emitted_text[-(max(map(len, stops)) - 1):] if max(map(len, stops)) > 1 else ""
        window = tail + pending
        hits = [i for i in (window.find(s) for s in stops) if i >= 0]
        if hits:
            cut = min(hits) - len(tail)
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

    def _finish(self, seq: Sequence, reason: str, notify: bool = True) -> None:
        seq.finish_reason = reason
        if seq.slot >= 0:
            self.backend.release(seq.slot)
        self.scheduler.remove(seq)
        n_out = len(seq.output_ids)
        if notify:
            seq.sink(RequestOutput(seq.request_id, "", [], reason, len(seq.prompt_ids), n_out))
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        self.observer.on_request_finished(reason, len(seq.prompt_ids), n_out,
                                          time.perf_counter() - seq.arrival, ttft)
