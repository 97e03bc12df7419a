"""Every Prometheus metric of the server, in one place.

The metrics are plain `prometheus_client` objects. BentoML runs its workers in Prometheus
multiprocess mode (it sets PROMETHEUS_MULTIPROC_DIR before a worker imports the service) and
its own /metrics endpoint aggregates every metric written to that directory, so ours appear on
BentoML's /metrics next to its `bentoml_*` ones without a second endpoint. That is also why
nothing here imports prometheus_client at module level: the import must happen after BentoML
has set the directory, i.e. when the service instance is created (`get_metrics()`).

`Metrics` is the engine's observer (see engine.EngineObserver): the engine calls it when a
sequence finishes, per output token and after every step.

A server runs one BentoML worker (the front end) and one engine process per GPU behind it
(engine/group.py): the engines' reports reach this worker, which adds them up, so each series is
the server's total. `realizar_engine_status` names each engine's device and state. Every series
also carries a `worker` label (BentoML's worker index, 1), so that a worker BentoML starts again
replaces the old one's series.

Beside ours, the vLLM names of the same quantities (`vllm:num_requests_running`, ... VLLM), so
that dashboards and autoscalers made for vLLM work unchanged: each is fed by the same call as its
realizar_ twin, with vLLM's `model_name` label (and `worker`).
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
GAUGES = {
    "requests_running": "Sequences in the running batch",
    "requests_waiting": "Sequences queued for KV-cache blocks",
    "kv_cache_usage_ratio": "KV-cache blocks in use over the blocks of the pool (0..1)",
    "kv_cache_used_blocks": "KV-cache blocks held by sequences",
    "kv_cache_used_tokens": "KV-cache positions held by sequences (a shared block counted once)",
    "decode_tokens_per_second": "Recent decode throughput over all running sequences",
    "graph_status": "Decode-step graph status per batch bucket (1 for the current status)",
    "buffer_pool_bytes": "Bytes held by the backend's preallocated buffer pools",
    "gpu_memory_used_bytes": "Device memory in use by this process",
    "worker_status": "The server's state (1 for the current one: loading, ready, failed)",
    "engine_status": "Each engine's state (1 for the current one: ready, stuck, dead, failed) and its device",
}


class Metrics:
    """One worker's metrics; implements the engine's observer protocol."""

    def __init__(self, registry=None, worker: str = "1", device: str = "cpu"):
        import prometheus_client as pc

        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        p, w = PREFIX, WORKER_LABEL
        self.worker, self.device = worker, device

        def mine(metric):            # the worker's own child of a metric with no other label
            return metric.labels(**{w: worker})

        # Counters and histograms sum naturally over worker processes (a worker that starts again
        # adds to the counts of the one before it).
        self.requests = pc.Counter(p + "requests", COUNTERS["requests_total"], ["finish_reason", w], **kw)
        self.request_errors = pc.Counter(p + "request_errors", COUNTERS["request_errors_total"],
                                         ["status_code", w], **kw)
        self.prompt_tokens = mine(pc.Counter(p + "prompt_tokens", COUNTERS["prompt_tokens_total"], [w], **kw))
        self.generation_tokens = mine(pc.Counter(p + "generation_tokens", COUNTERS["generation_tokens_total"],
                                                 [w], **kw))
        self.graph_replays = mine(pc.Counter(p + "graph_replays", COUNTERS["graph_replays_total"], [w], **kw))
        self.graph_captures = mine(pc.Counter(p + "graph_captures", COUNTERS["graph_captures_total"], [w], **kw))
        self.preemptions = mine(pc.Counter(p + "preemptions", COUNTERS["preemptions_total"], [w], **kw))
        self.prefix_queried = mine(pc.Counter(p + "prefix_cache_queried_tokens",
                                              COUNTERS["prefix_cache_queried_tokens_total"], [w], **kw))
        self.prefix_hits = mine(pc.Counter(p + "prefix_cache_hit_tokens",
                                           COUNTERS["prefix_cache_hit_tokens_total"], [w], **kw))
        self.decode_steps = pc.Counter(p + "decode_steps", COUNTERS["decode_steps_total"], ["start", w], **kw)
        self.engine_steps = pc.Counter(p + "engine_steps", COUNTERS["engine_steps_total"], ["kind", w], **kw)
        self.engine_step_seconds = pc.Counter(p + "engine_step_seconds", COUNTERS["engine_step_seconds_total"],
                                              ["kind", w], **kw)
        self.engine_prompt_tokens = mine(pc.Counter(p + "engine_step_prompt_tokens",
                                                    COUNTERS["engine_step_prompt_tokens_total"], [w], **kw))
        self.engine_idle = mine(pc.Counter(p + "engine_idle_seconds", COUNTERS["engine_idle_seconds_total"],
                                           [w], **kw))
        self.ttft = mine(pc.Histogram(p + "time_to_first_token_seconds", HISTOGRAMS["time_to_first_token_seconds"],
                                      [w], buckets=TTFT_BUCKETS, **kw))
        self.tpot = mine(pc.Histogram(p + "time_per_output_token_seconds",
                                      HISTOGRAMS["time_per_output_token_seconds"], [w], buckets=TPOT_BUCKETS, **kw))
        self.e2e = mine(pc.Histogram(p + "e2e_request_latency_seconds", HISTOGRAMS["e2e_request_latency_seconds"],
                                     [w], buckets=E2E_BUCKETS, **kw))
        self.prompt_length = mine(pc.Histogram(p + "prompt_length_tokens", HISTOGRAMS["prompt_length_tokens"],
                                               [w], buckets=PROMPT_BUCKETS, **kw))
        # Gauges: in multiprocess mode each needs an aggregation over processes. With the worker
        # label each series has one live process (a worker started again replaces the old one,
        # whose files forget_dead_processes() removes), so "live" modes give that worker's value
        # and drop the series of a worker that is gone; sum for counts and bytes, max for a ratio
        # or a status flag.
        def gauge(name: str, mode: str, labels=()):
            g = pc.Gauge(p + name, GAUGES[name], [*labels, w], multiprocess_mode=mode, **kw)
            return g if labels else mine(g)

        self.running = gauge("requests_running", "livesum")
        self.waiting = gauge("requests_waiting", "livesum")
        self.kv_usage = gauge("kv_cache_usage_ratio", "livemax")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "livesum")
        self.kv_used_tokens = gauge("kv_cache_used_tokens", "livesum")
        self.decode_rate = gauge("decode_tokens_per_second", "livesum")
        self.graph_status = gauge("graph_status", "livemax", ["bucket", "status"])
        self.pool_bytes = gauge("buffer_pool_bytes", "livesum")
        self.gpu_memory = gauge("gpu_memory_used_bytes", "livesum")
        self.worker_status = gauge("worker_status", "livemax", ["status", "device"])
        self.engine_status = gauge("engine_status", "livemax", ["engine", "device", "status"])
        for reason in ("stop", "length", "abort", "error", "shutdown"):
            self.requests.labels(reason, worker)          # present at 0 before the first request
        for status in ("400", "401", "404", "503"):
            self.request_errors.labels(status, worker)
        for start in DECODE_STARTS:
            self.decode_steps.labels(start, worker)
        self._last_steps: dict[str, int] = {}
        # the engine's cumulative step totals: (stats key, label) -> (counter child, last total seen);
        # the children made here are on /metrics at 0 before the first step
        self._step_totals: dict[tuple[str, str], tuple[Any, float]] = {}
        for kind in STEP_KINDS:
            self._step_totals["engine_steps", kind] = (self.engine_steps.labels(kind, worker), 0)
            self._step_totals["engine_step_seconds", kind] = (self.engine_step_seconds.labels(kind, worker), 0.0)
        self._step_totals["engine_step_prompt_tokens", ""] = (self.engine_prompt_tokens, 0)
        self._step_totals["engine_idle_seconds", ""] = (self.engine_idle, 0.0)
        self._intervals: list[float] = []        # token intervals not yet in the histogram
        self._lock = threading.Lock()             # on_step runs on the engine thread, refresh() elsewhere
        self._last_replays = 0
        self._last_captures = 0
        # the engine's cumulative KV totals: stats key -> (counter, last total seen)
        self._kv_totals = {"preemptions": (self.preemptions, 0),
                           "prefix_cache_queried_tokens": (self.prefix_queried, 0),
                           "prefix_cache_hit_tokens": (self.prefix_hits, 0)}
        # vLLM's names: the metrics now, their children once the model's name is known (the first
        # step report carries it); twin -> child, read by the event methods
        self._vllm_metrics = {}
        for name, (kind, twin, doc) in VLLM.items():
            labels = [VLLM_MODEL_LABEL, w]
            if kind == "counter":
                m = pc.Counter(name.removesuffix("_total"), doc, labels, **kw)
            elif kind == "histogram":
                buckets = {"time_to_first_token_seconds": TTFT_BUCKETS, "time_per_output_token_seconds": TPOT_BUCKETS,
                           "e2e_request_latency_seconds": E2E_BUCKETS}[twin]
                m = pc.Histogram(name, doc, labels, buckets=buckets, **kw)
            else:
                m = pc.Gauge(name, doc, labels, multiprocess_mode="livemax" if "usage" in twin else "livesum", **kw)
            self._vllm_metrics[twin] = m
        self.vllm: dict[str, Any] = {}
        self.model_name: str | None = None

    def _vllm(self) -> dict[str, Any]:
        """vLLM's children for this worker and model ("" until the engine has said its name)."""
        if not self.vllm:
            model = self.model_name or ""
            self.vllm = {twin: m.labels(model, self.worker) for twin, m in self._vllm_metrics.items()}
        return self.vllm

    def set_model_name(self, name: str) -> None:
        if name and name != self.model_name:
            for twin, child in self.vllm.items():      # gauges under the old name stop counting
                if twin in ("requests_running", "requests_waiting", "kv_cache_usage_ratio"):
                    child.set(0)
            self.model_name, self.vllm = name, {}

    # ---------------------------------------------------------------- EngineObserver

    def on_request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                            e2e_s: float, ttft_s: float | None) -> None:
        with self._lock:
            self._observe_intervals()
        v = self._vllm()
        self.requests.labels(finish_reason, self.worker).inc()
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
            self.gpu_memory.set(stats.get("device_memory_bytes", 0))
            graphs = stats.get("graph_status") or {}
            for bucket, status in graphs.items():
                for known in {*GRAPH_STATUSES, status}:
                    self.graph_status.labels(str(bucket), known, self.worker).set(1.0 if known == status else 0.0)
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
                    self.decode_steps.labels(start, self.worker).inc(total - last)
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

    # ---------------------------------------------------------------- serving side

    def on_http_error(self, status: int) -> None:
        self.request_errors.labels(str(status), self.worker).inc()

    def set_worker_status(self, status: str) -> None:
        for known in WORKER_STATUSES:
            self.worker_status.labels(known, self.device, self.worker).set(1.0 if known == status else 0.0)


    def set_engine_statuses(self, statuses: list[tuple[str, str]]) -> None:
        """statuses: (device, status) of engine 1, 2, ..."""
        for i, (device, status) in enumerate(statuses, 1):
            for known in ENGINE_STATUSES:
                self.engine_status.labels(str(i), device, known, self.worker).set(1.0 if known == status else 0.0)


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
