"""Every Prometheus metric of the server, in one place.

The metrics are plain `prometheus_client` objects. BentoML runs its workers in Prometheus
multiprocess mode (it sets PROMETHEUS_MULTIPROC_DIR before a worker imports the service) and
its own /metrics endpoint aggregates every metric written to that directory, so ours appear on
BentoML's /metrics next to its `bentoml_*` ones without a second endpoint. That is also why
nothing here imports prometheus_client at module level: the import must happen after BentoML
has set the directory, i.e. when the service instance is created (`get_metrics()`).

`Metrics.engine(i)` is engine i's observer (see engine.EngineObserver): the engine calls it when a
sequence finishes, per output token and after every step.

A server runs one or more BentoML workers (the front ends: Settings.front_ends) and one engine
process per GPU behind them (engine/group.py, engine/shared.py); each engine's events and reports
reach one worker (with several front ends, the one the engine reports to), which writes them as
that engine's series (label `engine`, from 1): a sum over the label gives the server's total, and
`realizar_engine_status` names each engine's device and state. Every series also carries a
`worker` label (BentoML's worker index, from 1), so that a worker BentoML starts again replaces
the old one's series; an engine's series may move from one worker to another when the one that
wrote them is gone (a sum over `worker` stays right: the next one counts on from the last report).

Beside ours, the vLLM names of the same quantities (`vllm:num_requests_running`, ... VLLM), so
that dashboards and autoscalers made for vLLM work unchanged: each is fed by the same call as its
realizar_ twin, with vLLM's `model_name` and `engine` labels (and `worker`).
"""

from __future__ import annotations

import bisect
import glob
import logging
import math
import os
import re
import threading
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "realizar_"

# Buckets sized for LLM serving: sub-10 ms GPU token intervals up to minute-long CPU requests.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
PROMPT_BUCKETS = tuple(float(2 ** i) for i in range(0, 18))      # 1 .. 131072 tokens

GRAPH_STATUSES = ("captured", "eager-fallback", "disabled")
# engine_steps_total's `kind` label (the engine's STEP_KINDS; not imported: serving's metrics
# name the engine's values without depending on it)
STEP_KINDS = ("decode", "prefill", "mixed")
# decode_steps_total's `start` label (engine/pipeline.py's PIPELINE_REASONS after "ahead")
DECODE_STARTS = ("ahead", "prefill", "finishing", "no_block", "off", "changed", "kind", "start")
WORKER_STATUSES = ("loading", "ready", "failed")
# an engine's state (EngineGroup.engine_statuses): failed at load, dead since, stuck for now
ENGINE_STATUSES = ("ready", "stuck", "dead", "failed")
WORKER_LABEL = "worker"

# (name, documentation): the public list, also used by the docs and the tests
COUNTERS = {
    "requests_total": "Finished sequences by finish reason (stop, length, abort, error, shutdown)",
    "request_errors_total": "Requests answered with an HTTP error, by status code",
    "prompt_tokens_total": "Prompt tokens prefilled",
    "generation_tokens_total": "Tokens generated",
    "graph_replays_total": "CUDA graph replays of the decode step",
    "graph_captures_total": "CUDA graph captures of the decode step",
    "preemptions_total": "Running sequences preempted for want of KV blocks (recomputed later)",
    "prefix_cache_queried_tokens_total": "Prompt tokens looked up in the KV prefix cache",
    "prefix_cache_hit_tokens_total": "Prompt tokens found in the KV prefix cache (not prefilled again)",
    "decode_steps_total": "Decode steps by how they started: ahead (before the previous step's tokens were "
                          "read, so the device never waits for the host) or why not (prefill, finishing, "
                          "no_block, off, changed, kind, start)",
    "engine_steps_total": "Engine steps by kind: decode (running sequences only), prefill (prompt chunks only), "
                          "mixed (both in one step)",
    "engine_step_seconds_total": "Wall time of the engine's steps by kind (a pipelined decode step includes "
                                 "waiting for the device)",
    "engine_step_prompt_tokens_total": "Prompt tokens computed by engine steps (a preempted sequence's "
                                       "recompute included); over prefill and mixed steps, their mean size",
    "engine_idle_seconds_total": "Time the engine's step loop waited with no work",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token",
    "time_per_output_token_seconds": "Time between consecutive output tokens of one sequence",
    "e2e_request_latency_seconds": "Time from arrival to the end of a sequence",
    "prompt_length_tokens": "Prompt length of finished sequences",
}
GAUGES = {
    "requests_running": "Sequences in the running batch",
    "requests_waiting": "Sequences queued for KV-cache blocks",
    "kv_cache_usage_ratio": "KV-cache blocks in use over the blocks of the pool (0..1)",
    "kv_cache_used_blocks": "KV-cache blocks held by sequences",
    "kv_cache_used_tokens": "KV-cache positions held by sequences (a shared block counted once)",
    "decode_tokens_per_second": "Recent decode throughput over all running sequences",
    "graph_status": "Decode-step graph status per batch bucket (1 for the current status)",
    "buffer_pool_bytes": "Bytes held by the backend's preallocated buffer pools",
    "recurrent_state_bytes": "Bytes of recurrent state the engine holds for its sequence slots (a hybrid's "
                             "linear-attention layers; 0 for other models)",
    "recurrent_state_bytes_per_sequence": "Bytes of recurrent state one sequence needs, beside its KV cache "
                                          "(a hybrid's linear-attention layers; 0 for other models)",
    "gpu_memory_used_bytes": "Device memory in use by this process",
    "worker_status": "The server's state (1 for the current one: loading, ready, failed)",
    "engine_status": "Each engine's state (1 for the current one: ready, stuck, dead, failed) and its device",
}


# vLLM's names (its v1 engine's), each fed with its realizar_ twin: name -> (type, twin, documentation)
VLLM = {
    "vllm:num_requests_running": ("gauge", "requests_running", "Requests in the running batch"),
    "vllm:num_requests_waiting": ("gauge", "requests_waiting", "Requests waiting to be admitted"),
    "vllm:kv_cache_usage_perc": ("gauge", "kv_cache_usage_ratio", "KV-cache usage, 0..1 (1 = full)"),
    "vllm:time_to_first_token_seconds": ("histogram", "time_to_first_token_seconds", "Time to first token"),
    "vllm:inter_token_latency_seconds": ("histogram", "time_per_output_token_seconds",
                                         "Time between consecutive output tokens"),
    "vllm:e2e_request_latency_seconds": ("histogram", "e2e_request_latency_seconds",
                                         "Time from arrival to the end of a request"),
    "vllm:prompt_tokens": ("counter", "prompt_tokens_total", "Prompt tokens processed"),
    "vllm:generation_tokens": ("counter", "generation_tokens_total", "Generation tokens produced"),
    "vllm:prefix_cache_queries": ("counter", "prefix_cache_queried_tokens_total",
                                  "Prompt tokens looked up in the prefix cache"),
    "vllm:prefix_cache_hits": ("counter", "prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache"),
}
VLLM_MODEL_LABEL = "model_name"
ENGINE_LABEL = "engine"


class Metrics:
    """The server's metrics: the front end's own (HTTP errors, its state, each engine's state)
    and, through engine(i), each engine's series."""

    def __init__(self, registry=None, worker: str = "1", device: str = "cpu"):
        import prometheus_client as pc

        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        p, w, e = PREFIX, WORKER_LABEL, ENGINE_LABEL
        self.worker, self.device = worker, device
        self._engines: dict[str, EngineObserverOf] = {}

        # Counters and histograms sum naturally over processes (a worker that starts again adds
        # to the counts of the one before it).
        self.requests = pc.Counter(p + "requests", COUNTERS["requests_total"], ["finish_reason", e, w], **kw)
        self.request_errors = pc.Counter(p + "request_errors", COUNTERS["request_errors_total"],
                                         ["status_code", w], **kw)

        def counter(name: str, labels=()):
            return pc.Counter(p + name.removesuffix("_total"), COUNTERS[name], [*labels, e, w], **kw)

        self.prompt_tokens = counter("prompt_tokens_total")
        self.generation_tokens = counter("generation_tokens_total")
        self.graph_replays = counter("graph_replays_total")
        self.graph_captures = counter("graph_captures_total")
        self.preemptions = counter("preemptions_total")
        self.prefix_queried = counter("prefix_cache_queried_tokens_total")
        self.prefix_hits = counter("prefix_cache_hit_tokens_total")
        self.decode_steps = counter("decode_steps_total", ["start"])
        self.engine_steps = counter("engine_steps_total", ["kind"])
        self.engine_step_seconds = counter("engine_step_seconds_total", ["kind"])
        self.engine_prompt_tokens = counter("engine_step_prompt_tokens_total")
        self.engine_idle = counter("engine_idle_seconds_total")

        def histogram(name: str, buckets):
            return pc.Histogram(p + name, HISTOGRAMS[name], [e, w], buckets=buckets, **kw)

        self.ttft = histogram("time_to_first_token_seconds", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", E2E_BUCKETS)
        self.prompt_length = histogram("prompt_length_tokens", PROMPT_BUCKETS)

        # Gauges: in multiprocess mode each needs an aggregation over processes. With the worker
        # label each series has one live process (a worker started again replaces the old one,
        # whose files forget_dead_processes() removes), so "live" modes give that worker's value
        # and drop the series of a worker that is gone; sum for counts and bytes, max for a ratio
        # or a status flag.
        def gauge(name: str, mode: str, labels=(), engine: bool = True):
            return pc.Gauge(p + name, GAUGES[name], [*labels, *([e] if engine else []), w],
                            multiprocess_mode=mode, **kw)

        self.running = gauge("requests_running", "livesum")
        self.waiting = gauge("requests_waiting", "livesum")
        self.kv_usage = gauge("kv_cache_usage_ratio", "livemax")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "livesum")
        self.kv_used_tokens = gauge("kv_cache_used_tokens", "livesum")
        self.decode_rate = gauge("decode_tokens_per_second", "livesum")
        self.graph_status = gauge("graph_status", "livemax", ["bucket", "status"])
        self.pool_bytes = gauge("buffer_pool_bytes", "livesum")
        self.state_bytes = gauge("recurrent_state_bytes", "livesum")
        self.state_bytes_per_seq = gauge("recurrent_state_bytes_per_sequence", "livemax")
        self.gpu_memory = gauge("gpu_memory_used_bytes", "livesum")
        self.worker_status = gauge("worker_status", "livemax", ["status", "device"], engine=False)
        self.engine_status = gauge("engine_status", "livemax", ["engine", "device", "status"], engine=False)
        for status in ("400", "401", "404", "503"):
            self.request_errors.labels(status, worker)       # present at 0 before the first request
        # vLLM's names: twin -> metric; each engine makes its children once it has said the model's name
        self.vllm: dict[str, Any] = {}
        for name, (kind, twin, doc) in VLLM.items():
            labels = [VLLM_MODEL_LABEL, e, w]
            if kind == "counter":
                metric = pc.Counter(name.removesuffix("_total"), doc, labels, **kw)
            elif kind == "histogram":
                buckets = {"time_to_first_token_seconds": TTFT_BUCKETS, "time_per_output_token_seconds": TPOT_BUCKETS,
                           "e2e_request_latency_seconds": E2E_BUCKETS}[twin]
                metric = pc.Histogram(name, doc, labels, buckets=buckets, **kw)
            else:
                metric = pc.Gauge(name, doc, labels, multiprocess_mode="livemax" if "usage" in twin else "livesum",
                                  **kw)
            self.vllm[twin] = metric

    def engine(self, index: int) -> "EngineObserverOf":
        """Engine `index`'s observer (from 1): its series, made when the engine first reports
        to this worker (with several front ends, an engine reports to one of them, and the
        others make none of its series: engine/shared.py)."""
        key = str(index)
        if key not in self._engines:
            self._engines[key] = EngineObserverOf(self, key)
        return self._engines[key]

    def on_http_error(self, status: int) -> None:
        self.request_errors.labels(str(status), self.worker).inc()

    def set_worker_status(self, status: str) -> None:
        for known in WORKER_STATUSES:
            self.worker_status.labels(known, self.device, self.worker).set(1.0 if known == status else 0.0)

    def set_engine_statuses(self, statuses: list[tuple[str, str]], mine: list[bool] | None = None) -> None:
        """statuses: (device, status) of engine 1, 2, ...; mine: which of them this worker writes
        (with several front ends, each engine's status is written by one: engine/shared.py)."""
        for i, (device, status) in enumerate(statuses, 1):
            if mine is not None and not mine[i - 1]:
                continue
            for known in ENGINE_STATUSES:
                self.engine_status.labels(str(i), device, known, self.worker).set(1.0 if known == status else 0.0)


class EngineObserverOf:
    """An engine's observer for this worker: its EngineMetrics (the series), made at the first
    report or event; a baseline that comes before (prime) waits for them."""

    def __init__(self, m: "Metrics", engine: str):
        self.m, self.engine = m, engine
        self.series: EngineMetrics | None = None
        self._baseline: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _made(self) -> "EngineMetrics":
        series = self.series
        if series is None:
            with self._lock:
                if self.series is None:
                    series = EngineMetrics(self.m, self.engine)
                    if self._baseline is not None:
                        series.prime(self._baseline)
                    self.series = series
                series = self.series
        return series

    def prime(self, stats: dict[str, Any]) -> None:
        with self._lock:
            if self.series is None:
                self._baseline = stats
                return
        self.series.prime(stats)

    def on_step(self, stats: dict[str, Any]) -> None:
        self._made().on_step(stats)

    def on_request_finished(self, *args) -> None:
        self._made().on_request_finished(*args)

    def on_token_interval(self, seconds: float) -> None:
        self._made().on_token_interval(seconds)


class EngineMetrics:
    """One engine's series; implements the engine's observer protocol (engine.EngineObserver):
    the engine calls it when a sequence finishes, per output token and after every step."""

    def __init__(self, m: Metrics, engine: str):
        w = m.worker
        self.m, self.engine, self.worker = m, engine, w

        def mine(metric, *labels):           # this engine's child of a metric
            return metric.labels(*labels, engine, w)

        self.prompt_tokens = mine(m.prompt_tokens)
        self.generation_tokens = mine(m.generation_tokens)
        self.graph_replays = mine(m.graph_replays)
        self.graph_captures = mine(m.graph_captures)
        self.ttft, self.tpot, self.e2e, self.prompt_length = (mine(h) for h in (m.ttft, m.tpot, m.e2e, m.prompt_length))
        self.running, self.waiting, self.kv_usage, self.kv_used_blocks, self.kv_used_tokens = (
            mine(g) for g in (m.running, m.waiting, m.kv_usage, m.kv_used_blocks, m.kv_used_tokens))
        self.decode_rate, self.pool_bytes, self.gpu_memory = (mine(g) for g in (m.decode_rate, m.pool_bytes,
                                                                                m.gpu_memory))
        self.state_bytes, self.state_bytes_per_seq = mine(m.state_bytes), mine(m.state_bytes_per_seq)
        self.requests = {reason: mine(m.requests, reason)     # present at 0 before the first request
                         for reason in ("stop", "length", "abort", "error", "shutdown")}
        self.decode_steps = {start: mine(m.decode_steps, start) for start in DECODE_STARTS}
        self._last_steps: dict[str, int] = {}
        # the engine's cumulative step totals: (stats key, label) -> (counter child, last total seen);
        # the children made here are on /metrics at 0 before the first step
        self._step_totals: dict[tuple[str, str], tuple[Any, float]] = {}
        for kind in STEP_KINDS:
            self._step_totals["engine_steps", kind] = (mine(m.engine_steps, kind), 0)
            self._step_totals["engine_step_seconds", kind] = (mine(m.engine_step_seconds, kind), 0.0)
        self._step_totals["engine_step_prompt_tokens", ""] = (mine(m.engine_prompt_tokens), 0)
        self._step_totals["engine_idle_seconds", ""] = (mine(m.engine_idle), 0.0)
        self._intervals: list[float] = []        # token intervals not yet in the histogram
        self._lock = threading.Lock()             # on_step runs on the engine's pipe thread, refreshes elsewhere
        self._last_replays = 0
        self._last_captures = 0
        # the engine's cumulative KV totals: stats key -> (counter, last total seen)
        self._kv_totals = {"preemptions": (mine(m.preemptions), 0),
                           "prefix_cache_queried_tokens": (mine(m.prefix_queried), 0),
                           "prefix_cache_hit_tokens": (mine(m.prefix_hits), 0)}
        self.vllm: dict[str, Any] = {}           # twin -> this engine's child of vLLM's name
        self.model_name: str | None = None

    def _vllm(self) -> dict[str, Any]:
        """vLLM's children for this engine and model ("" until the engine has said its name)."""
        if not self.vllm:
            model = self.model_name or ""
            self.vllm = {twin: metric.labels(model, self.engine, self.worker) for twin, metric in self.m.vllm.items()}
        return self.vllm

    def set_model_name(self, name: str) -> None:
        if name and name != self.model_name:
            for twin, child in self.vllm.items():      # gauges under the old name stop counting
                if twin in ("requests_running", "requests_waiting", "kv_cache_usage_ratio"):
                    child.set(0)
            self.model_name, self.vllm = name, {}

    def prime(self, stats: dict[str, Any]) -> None:
        """Take an engine's cumulative totals as already counted (another front end wrote them
        before this one took over the engine's series: engine/shared.py); the gauges follow at
        the next report."""
        with self._lock:
            self._last_replays = int(stats.get("graph_replays", 0))
            self._last_captures = int(stats.get("graph_captures", 0))
            self._last_steps = dict(stats.get("decode_steps") or {})
            for (key, label), (counter, _) in self._step_totals.items():
                value = stats.get(key)
                self._step_totals[key, label] = (counter, (value or {}).get(label, 0) if label else (value or 0))
            for key, (counter, _) in self._kv_totals.items():
                self._kv_totals[key] = (counter, int(stats.get(key, 0)))

    # ---------------------------------------------------------------- EngineObserver

    def on_request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                            e2e_s: float, ttft_s: float | None) -> None:
        with self._lock:
            self._observe_intervals()
        v = self._vllm()
        self.m.requests.labels(finish_reason, self.engine, self.worker).inc()
        for c in (self.prompt_tokens, v["prompt_tokens_total"]):
            c.inc(prompt_tokens)
        for c in (self.generation_tokens, v["generation_tokens_total"]):
            c.inc(completion_tokens)
        self.prompt_length.observe(prompt_tokens)
        for h in (self.e2e, v["e2e_request_latency_seconds"]):
            h.observe(e2e_s)
        if ttft_s is not None:
            for h in (self.ttft, v["time_to_first_token_seconds"]):
                h.observe(ttft_s)

    def on_token_interval(self, seconds: float) -> None:
        # kept, and observed together at the next step report or request end: one histogram
        # update per bucket touched, not one per token (each is a lock and memory-mapped writes)
        self._intervals.append(seconds)

    def _observe_intervals(self) -> None:
        if self._intervals:
            values, self._intervals = self._intervals, []
            observe_many(self.tpot, values)
            observe_many(self._vllm()["time_per_output_token_seconds"], values)

    def on_step(self, stats: dict[str, Any]) -> None:
        with self._lock:
            self.set_model_name(stats.get("model_name") or "")
            self._observe_intervals()
            v = self._vllm()
            for g in (self.running, v["requests_running"]):
                g.set(stats.get("running", 0))
            for g in (self.waiting, v["requests_waiting"]):
                g.set(stats.get("waiting", 0))
            for g in (self.kv_usage, v["kv_cache_usage_ratio"]):
                g.set(stats.get("kv_usage", 0.0))
            self.kv_used_blocks.set(stats.get("kv_used_blocks", 0))
            self.kv_used_tokens.set(stats.get("kv_used_tokens", 0))
            self.decode_rate.set(stats.get("decode_tokens_per_s", 0.0))
            self.pool_bytes.set(stats.get("pool_bytes", 0))
            self.state_bytes.set(stats.get("recurrent_state_bytes", 0))
            self.state_bytes_per_seq.set(stats.get("recurrent_state_bytes_per_sequence", 0))
            self.gpu_memory.set(stats.get("device_memory_bytes", 0))
            graphs = stats.get("graph_status") or {}
            for bucket, status in graphs.items():
                for known in {*GRAPH_STATUSES, status}:
                    self.m.graph_status.labels(str(bucket), known, self.engine, self.worker).set(
                        1.0 if known == status else 0.0)
            # the backend reports cumulative totals; counters only move forward by the delta
            replays, captures = int(stats.get("graph_replays", 0)), int(stats.get("graph_captures", 0))
            if replays > self._last_replays:
                self.graph_replays.inc(replays - self._last_replays)
                self._last_replays = replays
            if captures > self._last_captures:
                self.graph_captures.inc(captures - self._last_captures)
                self._last_captures = captures
            for start, total in (stats.get("decode_steps") or {}).items():
                last = self._last_steps.get(start, 0)
                if total > last:
                    child = self.decode_steps.get(start) or self.m.decode_steps.labels(start, self.engine, self.worker)
                    child.inc(total - last)
                    self._last_steps[start] = total
            for (key, label), (counter, last) in self._step_totals.items():
                value = stats.get(key)
                total = (value or {}).get(label, 0) if label else (value or 0)
                if total > last:
                    counter.inc(total - last)
                    self._step_totals[key, label] = (counter, total)
            for key, (counter, last) in self._kv_totals.items():
                total = int(stats.get(key, 0))
                if total > last:
                    counter.inc(total - last)
                    twin = v.get(key + "_total")
                    if twin is not None:
                        twin.inc(total - last)
                    self._kv_totals[key] = (counter, total)


_metrics: Metrics | None = None
_metrics_lock = threading.Lock()


def observe_many(histogram, values: list[float]) -> None:
    """histogram.observe(v) for every v, with one increment per bucket touched and one of the sum.
    Through the histogram child's bucket values (prometheus_client has no batch observe); a client
    without them gets the observations one by one."""
    bounds, buckets, total = (getattr(histogram, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for v in values:
            histogram.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect.bisect_left(bounds, v)       # the first bound >= v, as observe() picks
        counts[i] = counts.get(i, 0) + 1
    total.inc(math.fsum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


def get_metrics(worker: str = "1", device: str = "cpu") -> Metrics:
    """The process-wide Metrics of this worker (created on first use; registering twice would
    raise). Clears what crashed workers left behind first."""
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            forget_dead_processes()
            _metrics = Metrics(worker=worker, device=device)
        return _metrics


def _multiproc_dir() -> str | None:
    # the directory BentoML gave its workers; prometheus_client reads the same variable
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def forget_dead_processes() -> None:
    """Remove the "live" gauge files of processes that no longer run. A worker that exits
    cleanly does this itself; one that was killed (or crashed) leaves them, and their last
    values would otherwise be added to those of the worker that replaces it."""
    import prometheus_client.multiprocess as mp
    import psutil

    path = _multiproc_dir()
    if not path:
        return
    pids = set()
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        m = re.search(r"_(\d+)\.db$", f)
        if m:
            pids.add(int(m.group(1)))
    for pid in pids:
        if not psutil.pid_exists(pid):
            try:
                mp.mark_process_dead(pid, path)
            except FileNotFoundError:        # another worker removed them first
                pass


def metric_names() -> list[str]:
    """Every family name as the Prometheus text parser reports it (counters without _total)."""
    return ([PREFIX + n.removesuffix("_total") for n in COUNTERS]
            + [PREFIX + n for n in HISTOGRAMS] + [PREFIX + n for n in GAUGES] + list(VLLM))
