"""`realizar loadtest URL`: many concurrent streaming OpenAI clients against a running server.

Works against this package's server and any OpenAI-compatible one (llama-server, vLLM). Each of
`clients` workers sends streaming requests one after another until `requests` have been sent or
`duration` has passed; streams still open at the time limit are closed and reported as cut.

Prompts are fixed in length and different for every request of a run (so a prefix cache cannot
turn the run into a replay; a second run with the same --seed repeats the first one's prompts,
which the report's prefix-cache hits then show): in completions mode, random token ids sent as a token-id prompt, exact on
every server that accepts them; in chat mode, random common words, their number sized once
against the server's own count (`usage.prompt_tokens` of a few one-token requests), because chat
messages are text and the OpenAI API has no tokenize route. Outputs are greedy, `max_tokens` long,
with `ignore_eos` so that every request generates the same number of tokens.

Requests go through the official `openai` async client (URL, auth, error statuses), and the
stream is read as raw server-sent events, which keeps one client process fast enough to measure
tens of thousands of tokens per second. The clients are spread over processes of 16 (`--processes`),
because building a request through the official client costs ~2 ms: one process would send a wave
of 64 new requests late. Timing is taken on the client per streamed chunk that
carries text: time to first token, the gaps between chunks (inter-token latency), per-request time
per output token and end-to-end latency.
Tokens are counted from the usage chunk (`stream_options.include_usage`) when the server sends one,
else by chunks. The server's gauges (running, waiting, KV usage, ...) are read from /metrics before
and after, with counter deltas, when the server has them.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import RealizarError
from .serving.metrics import WORKER_LABEL

# Random prompt ids come from this range: above the special and byte tokens that open most
# vocabularies, below the specials some put at the end, and inside every common vocabulary.
PROMPT_ID_RANGE = (1000, 30000)
# Common English words: mostly one token each (with their leading space) in BPE vocabularies.
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education").split()
# Server metric families reported before and after the run, and the gauges that say it is idle.
METRIC_PREFIXES = ("realizar_", "llamacpp:", "vllm:")
BUSY_GAUGES = ("realizar_requests_running", "realizar_requests_waiting", "llamacpp:requests_processing",
               "llamacpp:requests_deferred", "vllm:num_requests_running", "vllm:num_requests_waiting")
SETTLE_S = 15.0            # how long to wait after the run for those gauges to reach 0
PREFIX_HITS = "realizar_prefix_cache_hit_tokens_total"   # this package's server: prompt tokens not prefilled
PROGRESS_EVERY_S = 5.0     # plain progress lines when stderr is not a terminal
CALIBRATION_ROUNDS = 4
CLIENTS_PER_PROCESS = 16   # streams per client process when --processes is 0
START_TIMEOUT_S = 120.0    # for client processes to start (import the client, connect)


@dataclass
class LoadtestConfig:
    url: str
    clients: int = 8
    requests: int = 64
    duration_s: float = 600.0
    prompt_tokens: int = 128
    max_tokens: int = 128
    model: str | None = None
    api_key: str | None = None
    mode: str = "completions"          # or "chat"
    random_cancel: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    processes: int = 0                 # client processes; 0: one per CLIENTS_PER_PROCESS clients

    def validate(self) -> None:
        for name in ("clients", "requests", "prompt_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.duration_s > 0:
            raise ValueError("--duration must be positive")
        if not 0.0 <= self.random_cancel <= 1.0:
            raise ValueError("--random-cancel must be a fraction between 0 and 1")
        if self.mode not in ("completions", "chat"):
            raise ValueError("--mode must be completions or chat")
        if self.processes < 0:
            raise ValueError("--processes must be 0 (automatic) or more")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"URL must start with http:// or https://, got {self.url!r}")

    @property
    def process_count(self) -> int:
        """Client processes: one asyncio loop drives CLIENTS_PER_PROCESS streams well, but a burst of
        new requests (64 streams ending together) costs it ~2 ms of request building each, so that
        later streams' ends are read late and the server idles between waves it did not make."""
        n = self.processes or min(-(-self.clients // CLIENTS_PER_PROCESS), os.cpu_count() or 1)
        return max(1, min(n, self.clients, self.requests))

    @property
    def root(self) -> str:
        """The server's root (where /metrics lives); a URL given with /v1 works too."""
        url = self.url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass
class _Result:
    index: int
    status: str = "running"            # ok | cancelled | cut | error
    start: float = 0.0
    end: float | None = None
    ttft: float | None = None
    done: float | None = None          # when the stream's end ([DONE]) was read; `end` is after the close
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0                    # chunks that carried text
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    error: tuple[str, str] | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


class _StreamError(Exception):
    """An error event inside a stream that had started (`data: {"error": {...}}`)."""

    def __init__(self, error):
        msg = error.get("message") if isinstance(error, dict) else None
        super().__init__(msg or str(error))


def _error_key(e: BaseException) -> tuple[str, str]:
    """(key, message): HTTP errors by status, transport errors by the exception under them."""
    import openai
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}", e.message
    if isinstance(e, openai.APIConnectionError):        # APITimeoutError included
        cause = e.__cause__ or e.__context__
        return (type(cause).__name__, str(cause) or repr(cause)) if cause else (type(e).__name__, str(e))
    if isinstance(e, _StreamError):
        return "error in stream", str(e)
    return type(e).__name__, str(e) or repr(e)


def _summary(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    a = np.asarray(xs, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()),
            "min": float(a.min()), "max": float(a.max()), "count": int(a.size)}


def _has_text(chunk: dict, chat: bool) -> bool:
    for c in chunk.get("choices") or ():
        if ((c.get("delta") or {}).get("content") if chat else c.get("text")):
            return True
    return False


# ------------------------------------------------------------------------------ server side

def _key(name: str, labels: dict[str, str]) -> str:
    shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{shown}}}" if shown else name


async def _server_metrics(root: str, headers: dict[str, str]) -> dict[str, dict[str, float]] | None:
    """Gauges and counters of the known server families on /metrics; None when there are none.
    This package's server labels each series with its worker (one per GPU): the values are
    given for the whole server (summed over the workers; a ratio gauge averaged) and, where
    there are several workers, for each of them too."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(root + "/metrics", headers=headers)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    per_worker: dict[tuple[bool, str], list[float]] = {}
    workers: set[str] = set()
    worker_keys: list[tuple[dict, str]] = []
    for fam in families:
        if not fam.name.startswith(METRIC_PREFIXES) or fam.type not in ("gauge", "counter", "histogram"):
            continue
        gauge = fam.type == "gauge"
        out = gauges if gauge else counters
        # a histogram's _sum and _count are counters too: their deltas give the run's server-side mean
        ends = ("_sum", "_count") if fam.type == "histogram" else ("_total",)
        for s in fam.samples:
            if not gauge and not s.name.endswith(ends):
                continue                     # _created timestamps, histogram buckets
            labels = dict(s.labels)
            worker = labels.pop(WORKER_LABEL, None) if s.name.startswith("realizar_") else None
            if worker is None:
                out[_key(s.name, labels)] = s.value
                continue
            workers.add(worker)
            out[_key(s.name, s.labels)] = s.value
            worker_keys.append((out, _key(s.name, s.labels)))
            per_worker.setdefault((gauge, _key(s.name, labels)), []).append(s.value)
    if len(workers) < 2:                     # one worker: its values are the server's
        for out, k in worker_keys:
            del out[k]
    for (gauge, key), values in per_worker.items():
        ratio = gauge and key.split("{")[0].endswith("_ratio")
        (gauges if gauge else counters)[key] = sum(values) / len(values) if ratio else sum(values)
    if not gauges and not counters:
        return None
    return {"gauges": gauges, "counters": counters}


async def _settled_metrics(root: str, headers: dict[str, str]) -> tuple[dict | None, bool]:
    """/metrics once the server's running and waiting gauges are back to 0 (or SETTLE_S passed)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = await _server_metrics(root, headers)
        busy = [m["gauges"][g] for g in BUSY_GAUGES if m and g in m["gauges"]]
        idle = bool(busy) and not any(busy)
        if m is None or idle or not busy or time.monotonic() > deadline:
            return m, idle
        await asyncio.sleep(0.25)


# ------------------------------------------------------------------------------ the run

class _Progress:
    """rich.progress on a terminal, else a plain line every PROGRESS_EVERY_S seconds (stderr)."""

    def __init__(self, total: int):
        self.total, self.done, self.errors, self.tokens = total, 0, 0, 0
        self.t0 = time.perf_counter()
        self.bar = None
        self.ticker: asyncio.Task | None = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("loadtest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("requests", total=total, info="")

    def _info(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return f"{self.errors} errors, {self.tokens / dt:,.1f} tok/s"

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            print(f"loadtest: {time.perf_counter() - self.t0:.0f} s, {self.done}/{self.total} requests, "
                  f"{self._info()}", file=sys.stderr, flush=True)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.start()
        else:
            self.ticker = asyncio.create_task(self._tick())

    def advance(self, res: _Result) -> None:
        self.set(self.done + 1, self.errors + (res.status == "error"), self.tokens + res.tokens)

    def set(self, done: int, errors: int, tokens: int) -> None:
        """The counts so far (client processes report theirs through shared counters)."""
        step, self.done, self.errors, self.tokens = done - self.done, done, errors, tokens
        if self.bar is not None and step:
            self.bar.update(self.task, advance=step, info=self._info())

    async def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.ticker is not None:
            self.ticker.cancel()
            await asyncio.gather(self.ticker, return_exceptions=True)


class _Runner:
    def __init__(self, cfg: LoadtestConfig, client, model: str, vocab: int | None, chat_words: int):
        self.cfg, self.client, self.model = cfg, client, model
        hi = min(PROMPT_ID_RANGE[1], vocab) if vocab else PROMPT_ID_RANGE[1]
        self.id_range = (min(PROMPT_ID_RANGE[0], hi // 2), hi)
        self.chat_words = chat_words

    def plan(self, i: int) -> tuple[Any, int | None]:
        """Request i's prompt and the number of text chunks after which it is cancelled (or None);
        seeded by (seed, i), so a run is the same whatever order the workers take requests in."""
        rng = np.random.default_rng([self.cfg.seed, i])
        if self.cfg.mode == "chat":
            prompt: Any = " ".join(rng.choice(WORDS, self.chat_words))
        else:
            prompt = rng.integers(*self.id_range, size=self.cfg.prompt_tokens).tolist()
        cancel = int(rng.integers(0, self.cfg.max_tokens)) if rng.random() < self.cfg.random_cancel else None
        return prompt, cancel

    def request(self, prompt):
        """The streaming request, through the official client but read as raw server-sent events:
        building a typed object per chunk would cost the client ~5x the CPU per token and cap
        what one process can measure (~14k chunks/s against ~80k raw)."""
        kw: dict[str, Any] = dict(model=self.model, max_tokens=self.cfg.max_tokens, temperature=0.0, stream=True,
                                  stream_options={"include_usage": True})
        if self.cfg.ignore_eos:
            kw["extra_body"] = {"ignore_eos": True}
        if self.cfg.mode == "chat":
            return self.client.chat.completions.with_streaming_response.create(
                messages=[{"role": "user", "content": prompt}], **kw)
        return self.client.completions.with_streaming_response.create(prompt=prompt, **kw)

    async def one(self, res: _Result) -> None:
        prompt, cancel_after = self.plan(res.index)
        chat = self.cfg.mode == "chat"
        res.start = time.perf_counter()
        try:
            # entering raises APIStatusError for an error status; leaving closes the connection
            # (which is how a cancelled stream is cancelled: the server sees the client go)
            async with self.request(prompt) as response:
                if cancel_after == 0:       # as soon as the response has started
                    res.status = "cancelled"
                    return
                last = res.start
                # one JSON object per `data:` line, as OpenAI-compatible servers send them
                async for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        res.done = time.perf_counter()
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise _StreamError(chunk["error"])
                    usage = chunk.get("usage")
                    if usage:
                        res.usage_tokens = usage.get("completion_tokens")
                        res.prompt_tokens = usage.get("prompt_tokens")
                    if _has_text(chunk, chat):
                        if res.ttft is None:
                            res.ttft = now - res.start
                        else:
                            res.gaps.append(now - last)
                        last = now
                        res.chunks += 1
                        if cancel_after is not None and res.chunks >= cancel_after:
                            res.status = "cancelled"
                            return
                res.status = "ok"
        finally:
            res.end = time.perf_counter()

    async def run(self, progress, indices: range | None = None, clients: int | None = None,
                  t0: float | None = None) -> tuple[list[_Result], float]:
        """`clients` workers send requests `indices` (default: all of them, with cfg.clients), each
        the next one when its last ends, until they are sent or cfg.duration_s from t0 passed."""
        indices = range(self.cfg.requests) if indices is None else indices
        counter = iter(indices)
        results: list[_Result] = []
        t0 = time.perf_counter() if t0 is None else t0
        deadline = t0 + self.cfg.duration_s

        async def worker() -> None:
            while True:
                i = next(counter, None)
                left = deadline - time.perf_counter()
                if i is None or left <= 0:
                    return
                res = _Result(i)
                results.append(res)
                try:
                    await asyncio.wait_for(self.one(res), left)
                except asyncio.TimeoutError:
                    res.status = "cut"
                except Exception as e:      # every failure is counted and reported, never raised
                    res.status, res.error = "error", _error_key(e)
                if res.end is None:
                    res.end = time.perf_counter()
                progress.advance(res)

        progress.start()
        try:
            await asyncio.gather(*(worker() for _ in range(self.cfg.clients if clients is None else clients)))
        finally:
            await progress.stop()
        return results, time.perf_counter() - t0


class _SharedCounts:
    """A client process's progress, added to counters the parent reads (done, errors, tokens)."""

    def __init__(self, counts):
        self.counts = counts

    def start(self) -> None:
        pass

    def advance(self, res: _Result) -> None:
        with self.counts.get_lock():
            self.counts[0] += 1
            self.counts[1] += res.status == "error"
            self.counts[2] += res.tokens

    async def stop(self) -> None:
        pass


def _client(cfg: LoadtestConfig):
    import openai
    # one pooled connection per client (the defaults keep only 100 alive); the type is the
    # client's own Limits class (httpx or httpx2, by openai version)
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=cfg.clients + 8,
                                                    max_keepalive_connections=cfg.clients + 8)
    http = openai.DefaultAsyncHttpxClient(limits=limits)
    return openai.AsyncOpenAI(base_url=cfg.root + "/v1", api_key=cfg.api_key or "unused", max_retries=0,
                              timeout=openai.Timeout(cfg.duration_s + 60.0, connect=10.0), http_client=http)


def _client_process(cfg: LoadtestConfig, p: int, procs: int, model: str, vocab: int | None, chat_words: int,
                    ready, counts, out) -> None:
    """One client process: requests p, p + procs, ... over its share of the clients, started when
    every process is ready; puts (results, the perf_counter when its last stream ended) or an error."""
    async def main():
        async with _client(cfg) as client:
            runner = _Runner(cfg, client, model, vocab, chat_words)
            t0 = ready.wait()
            clients = cfg.clients // procs + (p < cfg.clients % procs)
            results, _ = await runner.run(_SharedCounts(counts), range(p, cfg.requests, procs), clients, t0)
            return results, time.perf_counter()
    try:
        out.put(asyncio.run(main()))
    except BaseException as e:             # reported by the parent, which then stops
        ready.barrier.abort()               # nobody waits for this process at the start line
        out.put(RealizarError(f"a loadtest client process failed: {type(e).__name__}: {e}"))


class _StartLine:
    """Every process waits here; all leave at once, with the same perf_counter as the start."""

    def __init__(self, ctx, parties: int):
        self.barrier = ctx.Barrier(parties, timeout=START_TIMEOUT_S)
        self.t0 = ctx.Value("d", 0.0)

    def wait(self) -> float:
        if self.barrier.wait() == 0:
            self.t0.value = time.perf_counter()
        self.barrier.wait()
        return self.t0.value


async def _run_processes(cfg: LoadtestConfig, procs: int, model: str, vocab: int | None, chat_words: int,
                         progress: _Progress) -> tuple[list[_Result], float]:
    """The run over `procs` client processes (spawned: each its own interpreter and event loop);
    perf_counter is the system's monotonic clock, so their times line up with each other."""
    ctx = multiprocessing.get_context("spawn")
    ready, counts, out = _StartLine(ctx, procs + 1), ctx.Array("q", 3), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(cfg, p, procs, model, vocab, chat_words, ready, counts, out),
                           daemon=True) for p in range(procs)]
    for w in workers:
        w.start()
    try:
        try:
            t0 = await asyncio.to_thread(ready.wait)
        except threading.BrokenBarrierError:
            err = out.get(timeout=5) if not out.empty() else None
            raise err if isinstance(err, BaseException) else RealizarError(
                f"the loadtest client processes did not start within {START_TIMEOUT_S:g} s") from None
        progress.start()
        got: list = []
        while len(got) < procs:
            try:
                item = await asyncio.to_thread(out.get, True, 0.25)
            except Exception:                # queue.Empty: refresh the progress, look for a dead process
                item = None
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                got.append(item)
            progress.set(*(int(x) for x in counts[:]))
            if item is None and not any(w.is_alive() for w in workers) and out.empty():
                raise RealizarError("a loadtest client process ended without its results")
        await progress.stop()
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
            w.join(5)
    results = sorted((r for rs, _ in got for r in rs), key=lambda r: r.index)
    return results, max(end for _, end in got) - t0


async def _discover(client, cfg: LoadtestConfig) -> tuple[str, dict]:
    """The model to load (--model, else the first of /v1/models) and its card where listed."""
    try:
        cards = [m.model_dump() for m in (await client.models.list()).data]
    except Exception as e:
        if cfg.model:                        # a server without /v1/models can still be tested
            return cfg.model, {}
        key, msg = _error_key(e)
        raise RealizarError(f"cannot list the models at {cfg.root}/v1/models ({key}: {msg}); "
                            "is the server up? (or pass --model)") from None
    if cfg.model:
        return cfg.model, next((c for c in cards if c.get("id") == cfg.model), {})
    if not cards:
        raise RealizarError(f"{cfg.root}/v1/models lists no model; pass --model")
    return cards[0]["id"], cards[0]


async def _calibrate_chat(client, model: str, target: int, seed: int) -> tuple[int, int]:
    """How many random words make a chat prompt of `target` tokens on this server, template
    included: fit tokens = overhead + slope x words from the server's usage.prompt_tokens, then
    correct. Returns (words, tokens measured for that many)."""
    words = list(np.random.default_rng([seed, 1 << 30]).choice(WORDS, 4 * target + 64))

    async def measure(n: int) -> int:
        try:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": " ".join(words[:n])}], max_tokens=1,
                temperature=0.0)
        except Exception as e:
            key, msg = _error_key(e)
            raise RealizarError(f"sizing the chat prompt failed ({key}: {msg})") from None
        if r.usage is None or not r.usage.prompt_tokens:
            raise RealizarError("the server reports no usage.prompt_tokens; cannot size chat prompts "
                                "(use --mode completions)")
        return r.usage.prompt_tokens

    n, t = target, await measure(target)
    half = max(1, target // 2)
    slope = 1.0
    if half < n:
        t_half = await measure(half)
        slope = max((t - t_half) / (n - half), 0.1)
    for _ in range(CALIBRATION_ROUNDS):
        if t == target:
            break
        step = round((target - t) / slope)
        if step == 0 or n + step < 1:
            break
        n = min(n + step, len(words))
        t = await measure(n)
    return n, t


async def _loadtest(cfg: LoadtestConfig, keep: list | None = None) -> dict[str, Any]:
    """The run and its report; `keep` (a list) receives the per-request results."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with _client(cfg) as client:
        model, card = await _discover(client, cfg)
        context = card.get("max_model_len") or (card.get("meta") or {}).get("n_ctx_train")
        if context and cfg.prompt_tokens + cfg.max_tokens > context:
            raise ValueError(f"--prompt-tokens + --max-tokens ({cfg.prompt_tokens + cfg.max_tokens}) exceed "
                             f"the model's context of {context} tokens")
        chat_words, chat_tokens = 0, None
        if cfg.mode == "chat":
            chat_words, chat_tokens = await _calibrate_chat(client, model, cfg.prompt_tokens, cfg.seed)
        vocab = (card.get("meta") or {}).get("n_vocab")
        runner = _Runner(cfg, client, model, vocab, chat_words)
        procs = cfg.process_count
        where = f" in {procs} processes" if procs > 1 else ""
        print(f"loadtest: {cfg.clients} clients{where}, up to {cfg.requests} {cfg.mode} requests or "
              f"{cfg.duration_s:g} s, {cfg.prompt_tokens} prompt + {cfg.max_tokens} new tokens each, model {model!r} at {cfg.root}",
              file=sys.stderr, flush=True)
        before = await _server_metrics(cfg.root, headers)
        if procs == 1:
            results, elapsed = await runner.run(_Progress(cfg.requests))
        else:
            results, elapsed = await _run_processes(cfg, procs, model, vocab, chat_words, _Progress(cfg.requests))
        if keep is not None:
            keep.extend(results)
    after, settled = await _settled_metrics(cfg.root, headers) if before is not None else (None, False)
    return _report(cfg, model, results, elapsed, before, after, settled, chat_words, chat_tokens)


def _report(cfg, model, results, elapsed, before, after, settled, chat_words, chat_tokens) -> dict[str, Any]:
    by = {s: [r for r in results if r.status == s] for s in ("ok", "cancelled", "cut", "error")}
    errors: dict[str, dict[str, Any]] = {}
    for r in by["error"]:
        e = errors.setdefault(r.error[0], {"count": 0, "message": r.error[1]})
        e["count"] += 1
    ok = by["ok"]
    # a finished stream carries the server's usage where supported; a cancelled or cut one only chunks
    counted = {"usage" if r.usage_tokens is not None else "chunks" for r in results if r.tokens}
    output_tokens = sum(r.tokens for r in results)
    prompt = [r.prompt_tokens for r in results if r.prompt_tokens is not None]
    server = None
    if before is not None:
        after = after or {"gauges": {}, "counters": {}}
        delta = {k: v - before["counters"].get(k, 0.0) for k, v in after["counters"].items()}
        server = {"gauges_before": before["gauges"], "gauges_after": after["gauges"], "settled": settled,
                  "counters_delta": {k: v for k, v in delta.items() if not k.split("{")[0].endswith(("_sum", "_count"))},
                  "histogram_means": _histogram_means(delta),
                  # prompt tokens this run did not prefill (our server's counter; None elsewhere)
                  "prefix_cache_hit_tokens": sum(v for k, v in delta.items() if k.split("{")[0] == PREFIX_HITS)
                  if any(k.split("{")[0] == PREFIX_HITS for k in delta) else None}
    return {
        "url": cfg.root, "model": model, "mode": cfg.mode,
        "config": {"clients": cfg.clients, "requests": cfg.requests, "duration_s": cfg.duration_s,
                   "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens,
                   "random_cancel": cfg.random_cancel, "seed": cfg.seed, "ignore_eos": cfg.ignore_eos,
                   "processes": cfg.process_count},
        "chat_prompt_words": chat_words or None, "chat_prompt_tokens_sized": chat_tokens,
        "requests": {"sent": len(results), "completed": len(ok), "cancelled": len(by["cancelled"]),
                     "cut": len(by["cut"]), "errors": len(by["error"]),
                     "not_started": cfg.requests - len(results)},
        "errors": errors,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "tokens_counted_by": " and ".join(sorted(counted, reverse=True)) or None,
        "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None,
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "ttft_s": _summary([r.ttft for r in results if r.ttft is not None]),
        "itl_s": _summary([g for r in results for g in r.gaps]),
        "tpot_s": _summary([(r.end - r.start - r.ttft) / (r.tokens - 1) for r in ok
                            if r.ttft is not None and r.tokens > 1]),
        "e2e_s": _summary([r.end - r.start for r in ok]),
        "server": server,
    }


def _histogram_means(delta: dict[str, float]) -> dict[str, dict[str, float]]:
    """name{labels} -> {"mean", "count"} over the run, from a histogram's _sum and _count deltas:
    the server's own view (e.g. its time to first token from arrival, beside the client's)."""
    out = {}
    for key, count in delta.items():
        name, brace, labels = key.partition("{")
        if not name.endswith("_count") or count <= 0:
            continue
        base = name.removesuffix("_count")
        total = delta.get(base + "_sum" + brace + labels)
        if total is not None:
            out[base + brace + labels] = {"mean": total / count, "count": count}
    return out


# ------------------------------------------------------------------------------ output

def format_report(rep: dict[str, Any]) -> str:
    q = rep["requests"]
    lines = ["| loadtest | |", "|---|---|",
             f"| server | {rep['url']} |", f"| model | {rep['model']} ({rep['mode']}) |",
             f"| clients | {rep['config']['clients']} |",
             f"| requests | {q['sent']} sent: {q['completed']} completed, {q['cancelled']} cancelled, "
             f"{q['cut']} cut at the time limit, {q['errors']} errors ({q['not_started']} not started) |",
             f"| elapsed | {rep['elapsed_s']:.2f} s |",
             f"| output tokens | {rep['output_tokens']:,} (counted by {rep['tokens_counted_by'] or '-'}) |",
             f"| generation tok/s | {rep['output_tokens_per_s']:,.1f} |",
             f"| requests/s | {rep['requests_per_s']:.2f} |"]
    if rep["prompt_tokens_mean"] is not None:
        lines.append(f"| prompt tokens (mean, server's count) | {rep['prompt_tokens_mean']:.1f} |")
    lines += ["", "| latency (ms) | p50 | p90 | p99 | mean | max | n |", "|---|---|---|---|---|---|---|"]
    for name, key in (("time to first token", "ttft_s"), ("inter-token (per chunk)", "itl_s"),
                      ("time per output token", "tpot_s"), ("end to end", "e2e_s")):
        s = rep[key]
        if s:
            lines.append(f"| {name} | " + " | ".join(f"{1000 * s[k]:.1f}" for k in ("p50", "p90", "p99", "mean", "max"))
                         + f" | {s['count']} |")
        else:
            lines.append(f"| {name} | - | - | - | - | - | 0 |")
    if rep["errors"]:
        lines += ["", "| error | count | first message |", "|---|---|---|"]
        for key, e in sorted(rep["errors"].items(), key=lambda kv: -kv[1]["count"]):
            msg = " ".join(e["message"].split())[:120].replace("|", "/")
            lines.append(f"| {key} | {e['count']} | {msg} |")
    srv = rep["server"]
    if srv:
        lines += ["", "| server metric | before | after |", "|---|---|---|"]
        for k in sorted(set(srv["gauges_before"]) | set(srv["gauges_after"])):
            b, a = srv["gauges_before"].get(k), srv["gauges_after"].get(k)
            if b or a or k in BUSY_GAUGES or "kv_cache" in k:
                lines.append(f"| {k} | {_num(b)} | {_num(a)} |")
        for k, d in sorted(srv["counters_delta"].items()):
            if d:
                lines.append(f"| {k} | | +{_num(d)} |")
        if srv.get("histogram_means"):
            lines += ["", "| server histogram (this run) | mean | count |", "|---|---|---|"]
            for k, h in sorted(srv["histogram_means"].items()):
                unit = 1000.0 if "_seconds" in k else 1.0
                lines.append(f"| {k}{' (ms)' if unit != 1.0 else ''} | {_num(h['mean'] * unit)} | {_num(h['count'])} |")
        if not srv["settled"]:
            lines.append(f"| (server still busy {SETTLE_S:g} s after the run) | | |")
    return "\n".join(lines)


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.4g}"


def write_requests(results: list[_Result], path: str) -> None:
    """One JSON line per request, its times as Unix epoch seconds (to line up with a server's own
    logs or step trace): start, first token, end of stream read, closed; status and tokens."""
    epoch = time.time() - time.perf_counter()
    at = lambda t: None if t is None else round(epoch + t, 6)      # noqa: E731
    with open(path, "w") as f:
        for r in sorted(results, key=lambda r: r.index):
            f.write(json.dumps({"index": r.index, "status": r.status, "start": at(r.start),
                                "first_token": at(None if r.ttft is None else r.start + r.ttft),
                                "done": at(r.done), "end": at(r.end), "tokens": r.tokens,
                                "error": r.error[0] if r.error else None}) + "\n")


def run_loadtest(args) -> int:
    cfg = LoadtestConfig(url=args.url, clients=args.clients, requests=args.requests, duration_s=args.duration,
                         prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, model=args.model,
                         api_key=args.api_key, mode=args.mode, random_cancel=args.random_cancel, seed=args.seed,
                         ignore_eos=not args.no_ignore_eos, processes=args.processes)
    cfg.validate()
    results: list[_Result] = []
    rep = asyncio.run(_loadtest(cfg, results))
    if args.requests_out:
        write_requests(results, args.requests_out)
    print(format_report(rep), flush=True)
    hits = (rep["server"] or {}).get("prefix_cache_hit_tokens")
    if hits:
        print(f"loadtest: the server found {hits:,.0f} of this run's prompt tokens in its prefix cache and did not "
              f"prefill them (an earlier run with the same --seed?); use another --seed for prompt work like a "
              f"fresh load's", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 1 if rep["requests"]["errors"] else 0
