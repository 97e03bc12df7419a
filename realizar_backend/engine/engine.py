"""The engine: an async generate API over a step loop that batches every running sequence.

One background thread owns the backend and runs steps. The scheduler (engine/scheduler.py) plans
each step over the paged KV cache (engine/kv_manager.py); the engine carries it out on the
backend's model runner (backends/base.py: execute a step, sample it, read its result): it gives
the backend the block tables that changed, decodes every running sequence in one step that the
backend also samples (backends/sampling.py defines how), then prefills the planned prompt chunks
in another (the backend samples a sequence's first token at its last chunk, as it samples the
rest: no logits come back), and hands each sequence's new text to its caller (engine/outputs.py).
Callers iterate asynchronously (`generate`) or synchronously (`generate_sync`, for the CLI);
leaving the iteration early cancels the sequence and frees its KV blocks at once.

Constrained decoding (engine/guidance.py): a request's grammar is compiled in `prepare`, each of
its sequences gets a Guide, every token drawn is consumed by it, and a complete grammar ends the
sequence. Every decode step is pipelined the same way (engine/pipeline.py): a constrained row's
mask (a grammar's) for step n+1 is computed while its forward pass runs, after the host has consumed
step n's token; rows without one never see a mask (a step whose rows are all plain greedy the
backend may answer with the forward pass's argmax).

Here: the request side (generate, abort, stats, shutdown; prepare is engine/prep.py's, shared
with engine/process.py, which runs this engine in a process of its own) and the step loop, which plans
with the scheduler, runs the plan (prefill here, the pipelined decode step in engine/pipeline.py),
accepts each token drawn (`_accept`: the grammar's check, timing, logprobs; its text and stop
checks are engine/outputs.py's text_and_stop, its output queued in an Outbox there) and ends
sequences (`_finish`, `_fail`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Protocol

import numpy as np

from .. import timeline
from ..backends import Backend, PrefillItem, SampleResult, SampleRow, Step, create_backend, run_step, start_device
from ..errors import CapacityError, ContextOverflowError, GrammarError, GrammarLimitError
from ..formats import open_model
from ..model.default import default_model_path
from ..settings import Settings
from .guidance import Guidance
from .kv_manager import KVManager
from .outputs import LoopSink, Outbox, RequestOutput, drain_merged, drain_text, queue_outputs, text_and_stop
from .pipeline import DecodePipeline
from .prep import RequestPrep
from .sampling import Sampler, SamplingParams, token_logprobs
from .scheduler import Scheduler, Sequence
from .token_rules import TokenRules

log = logging.getLogger(__name__)

# what a step of the loop did: decode rows only, prompt chunks only, or both in one step
STEP_KINDS = ("decode", "prefill", "mixed")

__all__ = ["Engine", "EngineObserver", "NullObserver", "RequestOutput", "drain_merged"]


def served_name(path: Path) -> str:
    """The model id a server reports and requests name, for a model given by path: the file's
    name without `.gguf` (a safetensors directory: its name), which a client can type and a curl
    line can carry, unlike a GGUF's `general.name` ("Smollm2 135M 8k Lc100K Mix1 Ep2").
    REALIZAR_MODEL_NAME overrides it."""
    name = path.name
    return name[:-5] if name.lower().endswith(".gguf") and len(name) > 5 else name


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


class Engine(RequestPrep):
    def __init__(self, backend: Backend, tokenizer, settings: Settings | None = None,
                 model_name: str = "model", observer: EngineObserver | None = None,
                 prewarm_guidance: bool = True, pipelined: bool = True, check_grammars: bool = True):
        """prewarm_guidance: build llguidance's vocabulary now, on a thread (False: on the first
        constrained request, or when the caller calls prewarm_guidance(), e.g. once it serves).
        pipelined: start decode step n+1 on the device's own tokens before the host reads step n's
        (False: every step waits for the host; the reference the tests compare it with).
        check_grammars: `prepare` tries each new grammar in a worker process first (guidance.py);
        False for an engine whose requests another process prepares (engine/process.py)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.settings = settings or Settings()
        self.config = backend.config
        self.model_name = model_name
        self.observer = observer or NullObserver()
        self.max_context = backend.max_context
        prefix_caching = self.settings.enable_prefix_caching
        if prefix_caching and self.config.has_recurrent_state:
            # a hybrid's sequence resumes from its recurrent state, which no KV block holds: a cached
            # prefix could not be skipped
            log.info("prefix caching off: %s layers keep a recurrent state per sequence", self.config.arch)
            prefix_caching = False
        self.kv = KVManager(backend.num_blocks, backend.block_size, prefix_caching)
        self.kv_capacity = backend.num_blocks * backend.block_size      # tokens
        self.scheduler = Scheduler(self.kv, backend.max_slots, self.settings.max_waiting,
                                   self.settings.prefill_chunk_tokens)
        self._stop = False
        self._closing: str | None = None      # finish_all(reason): end everything, take nothing new
        self._decode_window: list[tuple[float, int]] = []   # (time, tokens) of recent decode steps
        self._outbox = Outbox()             # this step's outputs, delivered by its flush()
        # the decode step on the device, and the step started ahead of it
        self.pipelined = pipelined
        self.pipeline = DecodePipeline(self, prefill=self._prefill, flush=self._flush)
        self._last_shape: tuple[int, int] = (-1, -1)
        self._last_report = 0.0
        self._said_preempt = False
        # what the step loop's time went to, cumulative (the metrics' engine_* counters)
        self.step_counts = dict.fromkeys(STEP_KINDS, 0)
        self.step_seconds = dict.fromkeys(STEP_KINDS, 0.0)
        self.step_prompt_tokens = 0
        self.idle_seconds = 0.0
        self._step_kind: str | None = None
        self._busy_since: float | None = None      # when the step now running began (None: waiting)
        self._step_work = (0, 0, 0)          # this step's prompt tokens, prompt sequences, decode rows
        self._trace = open(self.settings.step_trace, "a", buffering=1) if self.settings.step_trace else None
        self._t_start = time.perf_counter()
        self._epoch = time.time() - self._t_start          # perf_counter -> Unix time, for the trace
        self.guidance = Guidance(tokenizer, self.config.vocab_size, pool_size=backend.max_slots,
                                 check_timeout_s=self.settings.grammar_timeout_s if check_grammars else None,
                                 check_workers=self.settings.grammar_workers)
        if prewarm_guidance:
            self.prewarm_guidance(checks=False)
        self._thread = threading.Thread(target=self._loop, name="realizar-engine", daemon=True)
        self._thread.start()

    def prewarm_guidance(self, delay_s: float = 0.0, checks: bool = True) -> None:
        """Build llguidance's view of the vocabulary on a thread, after delay_s: it takes 0.2-3 s,
        not to be paid by the first constrained request. It holds the GIL while it builds, so
        every other thread of the process waits meanwhile. checks: start the grammar check
        workers too (a server's engine; a CLI's starts them on its first constrained request)."""
        def run() -> None:
            if delay_s > 0:
                time.sleep(delay_s)
            try:
                self.guidance.prewarm(checks)
            except Exception:       # said now; a constrained request meets the same error
                log.warning("constrained decoding (llguidance) could not read this tokenizer", exc_info=True)
        threading.Thread(target=run, name="realizar-guidance", daemon=True).start()

    @classmethod
    def from_settings(cls, settings: Settings | None = None, observer: EngineObserver | None = None,
                      prewarm_guidance: bool = True, pipelined: bool = True,
                      check_grammars: bool = True) -> "Engine":
        from ..model.chat_template import TemplateLimits
        from ..model.tokenizer import Tokenizer
        settings = settings or Settings.from_env()
        path = Path(settings.model) if settings.model else default_model_path(settings)
        t0 = time.perf_counter()
        start_device(settings)
        model = open_model(path)
        timeline.mark("model file opened")

        def tokenizer_of(model):
            tok = Tokenizer.from_model_file(model, TemplateLimits.from_settings(settings))
            timeline.mark("tokenizer ready (chat template checked)")
            return tok

        # the tokenizer (a vocabulary of 150k+ entries: ~0.5 s, all of it holding the GIL) builds
        # while the backend starts: beside the device context's creation (start_device's thread),
        # or, where that is done already (a server's worker), in the weight upload's long copies
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tok = pool.submit(tokenizer_of, model)
            backend = create_backend(model, settings)
            timeline.mark("%s backend ready", backend.name)
            try:
                tokenizer = tok.result()
            except BaseException:
                backend.close()
                raise
        name = settings.model_name or (served_name(path) if settings.model else "SmolLM2-135M-Instruct")
        log.info("loaded %s (%s, %s backend) in %.1f s", name, model.config.arch, backend.name,
                 time.perf_counter() - t0)
        engine = cls(backend, tokenizer, settings, model_name=name, observer=observer,
                     prewarm_guidance=prewarm_guidance, pipelined=pipelined, check_grammars=check_grammars)
        timeline.mark("engine ready")
        return engine

    # ------------------------------------------------------------------ request side

    def _new_sequence(self, ids: list[int], params: SamplingParams, request_id: str | None, sink) -> Sequence:
        if self._closing is not None:
            raise CapacityError("the server is shutting down; retry on another replica", retry_after_s=5)
        if params.max_tokens is None or len(ids) + params.max_tokens > min(self.max_context, self.kv_capacity):
            raise ContextOverflowError(f"prompt plus max_tokens exceeds the context of {self.max_context} "
                                       f"tokens or the KV cache of {self.kv_capacity}")
        guide = self.guidance.guide(params.constraint) if params.constraint is not None else None
        return Sequence(request_id=request_id or uuid.uuid4().hex, prompt_ids=list(ids), params=params,
                        sampler=Sampler(params, self.config.vocab_size), sink=sink,
                        detok=self.tokenizer.detokenizer(ids), guide=guide,
                        rules=TokenRules.for_params(params, self.tokenizer.stop_ids, self.guidance.words))

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, sink) -> None:
        """Queue a prepared request whose outputs go to sink (a callable, or an outputs sink class)."""
        self.scheduler.submit(self._new_sequence(prompt_ids, params, request_id, sink))

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs, asynchronously; it is queued at the first iteration, and leaving
        the iteration early cancels it."""
        q: asyncio.Queue = asyncio.Queue()
        seq: list[Sequence] = []

        def start() -> None:
            seq.append(self._new_sequence(prompt_ids, params, request_id, LoopSink(asyncio.get_running_loop(), q)))
            self.scheduler.submit(seq[0])

        def leave(done: bool) -> None:
            if not done:
                self.scheduler.abort(seq[0].request_id)

        return queue_outputs(q, start, leave)

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
        s, kv = self.scheduler, self.kv
        b = self.backend.stats()
        return {
            "backend": self.backend.name,
            "model_name": self.model_name,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_usage": kv.usage,                 # blocks in use / blocks in the pool
            "kv_used_blocks": kv.used_blocks,
            "kv_used_tokens": kv.used_tokens,
            "kv_total_blocks": kv.num_blocks,
            "kv_waiting_blocks": s.waiting_blocks(),
            "preemptions": s.preemptions,         # the three counts are cumulative
            "prefix_cache_queried_tokens": kv.queried_tokens,
            "prefix_cache_hit_tokens": kv.hit_tokens,
            "decode_tokens_per_s": self._decode_rate(),
            "graph_status": b.get("graph_status", {}),
            "pool_bytes": b.get("pool_bytes", 0),
            "recurrent_state_bytes": b.get("recurrent_state_bytes", 0),   # a hybrid's, within pool_bytes
            # what one sequence's slot needs of it (the model's, whether or not the slots are made yet)
            "recurrent_state_bytes_per_sequence": self.config.recurrent_state_bytes,
            "device_memory_bytes": b.get("device_memory_bytes", 0),
            "graph_replays": b.get("graph_replays", 0),
            "graph_captures": b.get("graph_captures", 0),
            "decode_steps": dict(self.pipeline.steps),     # cumulative, by how each step started
            "engine_steps": dict(self.step_counts),        # cumulative, by kind (STEP_KINDS)
            "engine_step_seconds": dict(self.step_seconds),
            "engine_step_prompt_tokens": self.step_prompt_tokens,
            "engine_idle_seconds": self.idle_seconds,
        }

    def busy_s(self) -> float:
        """How long the step now running has run (0 while the loop waits for work): the engine's
        heartbeat. A step that runs past Settings.engine_stall_timeout_s means a stuck engine."""
        since = self._busy_since
        return time.perf_counter() - since if since is not None else 0.0

    def stall(self) -> str | None:
        """Why this engine is stuck (a step running past Settings.engine_stall_timeout_s), or None."""
        busy = self.busy_s()
        if busy > self.settings.engine_stall_timeout_s:
            return f"the engine's current step has run for {busy:.0f} s"
        return None

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
        if self._trace is not None:
            self._trace.close()

    # ------------------------------------------------------------------ step loop (one thread)

    def _loop(self) -> None:
        sch = self.scheduler
        while True:
            with sch.wakeup:
                idle = not self._stop and not sch.has_work()
            if idle:
                if self.pipeline.ahead is not None:
                    # every sequence of the step started ahead stopped: wait for it, free what it held
                    self.pipeline.drop_ahead()
                    self.observer.on_step(self.stats())
                self._flush()
            with sch.wakeup:
                t_idle = time.perf_counter()
                while not self._stop and not sch.has_work():
                    sch.wakeup.wait()
                if self._stop:
                    break
            t0 = time.perf_counter()
            idle_s = t0 - t_idle if idle else 0.0
            self.idle_seconds += idle_s
            self._step_kind = None
            self._busy_since = t0
            try:
                self._step()
            except Exception as e:  # a backend failure must not kill the loop or the waiting requests
                log.exception("engine step failed; failing the running requests")
                self.pipeline.abandon_ahead()
                for seq in list(sch.running):
                    self._fail(seq, e)
                self._flush()
            finally:
                self._busy_since = None
            if self._step_kind is not None:
                wall = time.perf_counter() - t0
                self.step_counts[self._step_kind] += 1
                self.step_seconds[self._step_kind] += wall
                if self._trace is not None:
                    self._trace_step(t0, wall, idle_s)
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
            self._flush()
            return
        aborts = sch.take_aborts()
        if aborts:
            self.pipeline.drop_ahead()      # a cancelled sequence's blocks are free at once, once no step writes them
        for rid in aborts:
            seq = sch.find(rid)
            if seq is not None:
                self._finish(seq, "abort")
        plan = sch.schedule()
        # a step started ahead serves this step when it computes every sequence the plan decodes (its
        # other rows have stopped since: their outputs are dropped); else it is waited for first, so
        # that no slot or block it writes changes hands under it
        if self.pipeline.ahead is not None and not self.pipeline.serves(plan):
            self.pipeline.drop_ahead()
        for slot in plan.released:
            self.backend.release(slot)
        for seq, err in plan.failed:
            self._fail(seq, err)
        if plan.preempted:
            # said once at INFO (a sign the pool is small for the load); the metrics count them all
            log.log(logging.DEBUG if self._said_preempt else logging.INFO,
                    "KV cache full (%d blocks): preempted %d sequence(s), recomputed when blocks free up",
                    self.kv.num_blocks, len(plan.preempted))
            self._said_preempt = True
        if plan.tables:
            self.backend.set_block_tables(plan.tables)
        if plan.decode or plan.prefill:
            self._step_kind = ("mixed" if plan.prefill else "decode") if plan.decode else "prefill"
            self._step_work = (sum(n for _, _, n in plan.prefill), len(plan.prefill), len(plan.decode))
            self.step_prompt_tokens += self._step_work[0]
        if plan.decode:
            self._decode(plan.decode, plan.prefill)
        else:
            self.pipeline.drop_ahead()
            self.pipeline.why = "start"
            if plan.prefill:
                self._prefill(plan.prefill)
            self._flush()
        # else the next step delivers this one's outputs once its forward pass is launched

    def _trace_step(self, t0: float, wall: float, idle_s: float) -> None:
        tokens, seqs, rows = self._step_work
        sch = self.scheduler
        self._trace.write(json.dumps({
            "t_ms": round(1e3 * (t0 - self._t_start), 3), "epoch": round(self._epoch + t0, 6),
            "kind": self._step_kind, "prompt_tokens": tokens, "prompt_seqs": seqs, "decode_rows": rows,
            "ms": round(1e3 * wall, 3), "idle_ms": round(1e3 * idle_s, 3),
            "waiting": len(sch.waiting), "running": len(sch.running)}) + "\n")

    def _prefill(self, chunks: list[tuple[Sequence, int, int]]) -> None:
        """The step's prompt chunks in one call. A chunk that completes its sequence's prompt has
        the backend sample the first token there, drawn as every later one (pipeline.draw_rows:
        seed and step, penalties, grammar mask, logprobs); a sequence recomputed after a
        preemption (it has tokens already) decodes on. A penalised sequence's token counts are
        reset before the call: the first draw reads them."""
        items, firsts = [], []
        for seq, start, n in chunks:
            items.append(PrefillItem(seq.slot, np.asarray(seq.tokens(start, start + n), np.int32), start))
            complete = start + n >= seq.kv_target
            if complete and seq.sampler.needs_counts:
                prompt = np.asarray(seq.prompt_ids, np.int32)
                if len(seq.output_ids) > 1:      # resumed: counts of what it had generated
                    self.backend.reset_counts(seq.slot, prompt, np.asarray(seq.output_ids[:-1], np.int32))
                else:
                    self.backend.reset_counts(seq.slot, prompt)
            firsts.append(complete and not seq.output_ids)
        drawn = [i for i, first in enumerate(firsts) if first]
        rows, prepare = self.pipeline.draw_rows([chunks[i][0] for i in drawn])
        by_item: list[SampleRow | None] = [None] * len(items)
        for i, row in zip(drawn, rows):
            by_item[i] = row
        res = run_step(self.backend, Step(prompts=items), by_item, prepare)
        timeline.once("first prefill step done")
        for seq, _, n in chunks:
            self.scheduler.computed(seq, n)
        self._accept_sampled([(i, chunks[i][0]) for i in drawn], res)

    def _decode(self, decode: list[Sequence], prefill: list[tuple[Sequence, int, int]]) -> None:
        """One decode step for `decode` (the plan's), on the pipeline (engine/pipeline.py: the step's
        prefill runs once it is queued, and the next step starts ahead), then its tokens accepted."""
        batch, live, out = self.pipeline.step(decode, prefill)
        rows = [(i, s) for i, s in enumerate(batch) if id(s) in live]
        for _, seq in rows:
            self.scheduler.computed(seq, 1)
        self._accept_sampled(rows, out)
        self._decode_window.append((time.perf_counter(), len(decode)))
        del self._decode_window[:-64]

    def _decode_rate(self) -> float:
        w = self._decode_window
        if len(w) < 2 or time.perf_counter() - w[-1][0] > 2.0:
            return 0.0
        span = w[-1][0] - w[0][0]
        return sum(n for _, n in w[1:]) / span if span > 0 else 0.0

    def _end_all(self, reason: str) -> None:
        self.pipeline.drop_ahead()
        for seq in list(self.scheduler.running):
            text = drain_text(seq)
            seq.emitted_text += text
            self._emit(seq, RequestOutput(seq.request_id, text, [], reason, len(seq.prompt_ids),
                                          len(seq.output_ids), cached_tokens=seq.cached_tokens or 0))
            self._finish(seq, reason, notify=False)
        for seq in list(self.scheduler.waiting):
            self._emit(seq, CapacityError("the server is shutting down; retry on another replica", retry_after_s=5))
            self._finish(seq, reason, notify=False)
        self.scheduler.take_aborts()

    # ------------------------------------------------------------------ tokens accepted, sequences ended

    def _retire(self, seq: Sequence) -> None:
        """Take an ended sequence out of the scheduler. Its slot and blocks are free at once, unless
        the step started ahead computes it: then when that step is done (DecodePipeline.free_held)."""
        if self.pipeline.hold(seq):
            return
        if seq.slot >= 0:
            self.backend.release(seq.slot)
        self.scheduler.remove(seq)

    def _release_guide(self, seq: Sequence) -> None:
        if seq.guide is not None:
            guide, seq.guide = seq.guide, None
            self.guidance.release(guide)

    def _accept_sampled(self, rows: list[tuple[int, Sequence]], res: SampleResult) -> None:
        """Accept the tokens a backend sampled: row i of `res` for each (i, sequence). The
        constrained rows' tokens are consumed by their grammars at once, on llguidance's threads;
        logprobs are the backend's (the top one), or come from the row's logits (more)."""
        guided = [(i, s) for i, s in rows if s.guide is not None]
        ok = iter(self.guidance.consume_all([s.guide for _, s in guided], [int(res.tokens[i]) for i, _ in guided])
                  if guided else ())
        for i, seq in rows:
            lp = None
            if seq.params.logprobs in (0, 1):
                top = [(int(res.top_ids[i]), float(res.top_logprobs[i]))] if seq.params.logprobs else []
                lp = (float(res.logprobs[i]), top)
            self._accept(seq, int(res.tokens[i]), lp, res.logits.get(i),
                         consumed=next(ok) if seq.guide is not None else None)

    def _accept(self, seq: Sequence, token: int,
                logprobs: tuple[float, list[tuple[int, float]]] | None = None,
                logits: np.ndarray | None = None, consumed: bool | None = None) -> None:
        """Take a token the backend drew: the grammar's check, then emit and check stop
        conditions (outputs.text_and_stop).
        logprobs: (chosen, top) when the backend computed them; else they come from `logits`.
        consumed: whether the guide took the token, when the caller has already given it."""
        p = seq.params
        guide = seq.guide
        if consumed is None and guide is not None:
            consumed = guide.consume(token)
        if guide is not None and not consumed:
            if guide.hit_limit:
                first = " ".join(guide.error.split("\n<state>")[0].split())[:400]
                self._fail(seq, GrammarLimitError(f"{p.constraint.param}: the output reached a limit of the grammar "
                                                  f"engine after {len(seq.output_ids)} tokens ({first})",
                                                  param=p.constraint.param))
            else:
                self._fail(seq, GrammarError(f"constrained decoding: token {token} "
                                             f"({self.tokenizer.token_text(token)!r}) was sampled where the "
                                             f"grammar ({p.constraint.param}) does not allow it: {guide.error}"))
            return
        seq.output_ids.append(token)
        if seq.rules is not None:
            seq.rules.observe(seq.output_ids)
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
            timeline.once("first token drawn")
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

        text, reason = text_and_stop(seq, token, self.tokenizer.stop_ids)
        seq.emitted_text += text
        self._emit(seq, RequestOutput(seq.request_id, text, [token], reason, len(seq.prompt_ids),
                                      len(seq.output_ids), lp, seq.cached_tokens or 0,
                                      seq.stop_string if reason is not None else None))
        if reason is not None:
            self._finish(seq, reason, notify=False)

    def _emit(self, seq: Sequence, item: Any) -> None:
        """Queue an output (or an exception) for the sequence's caller; _flush delivers it."""
        self._outbox.emit(seq.sink, item)

    def _flush(self) -> None:
        """Deliver the step's queued outputs (outputs.Outbox.flush: one wakeup per event loop)."""
        self._outbox.flush()

    def _finish(self, seq: Sequence, reason: str, notify: bool = True) -> None:
        seq.finish_reason = reason
        self._release_guide(seq)
        self._retire(seq)
        n_out = len(seq.output_ids)
        if notify:
            self._emit(seq, RequestOutput(seq.request_id, "", [], reason, len(seq.prompt_ids), n_out,
                                          cached_tokens=seq.cached_tokens or 0))
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        self.observer.on_request_finished(reason, len(seq.prompt_ids), n_out,
                                          time.perf_counter() - seq.arrival, ttft)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        """End a sequence with an error its caller receives (the other sequences go on)."""
        seq.finish_reason = "error"
        self._release_guide(seq)
        self._retire(seq)
        self._emit(seq, err)
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        self.observer.on_request_finished("error", len(seq.prompt_ids), len(seq.output_ids),
                                          time.perf_counter() - seq.arrival, ttft)
