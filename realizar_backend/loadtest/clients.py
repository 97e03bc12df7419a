"""The clients: streaming requests through the official `openai` client, read as raw server-sent
events, in one event loop or spread over spawned processes that leave one start line together."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import threading
import time
from typing import Any

import numpy as np

from ..errors import RealizarError
from .config import (PROGRESS_EVERY_S, PROMPT_ID_RANGE, START_TIMEOUT_S, WORDS, LoadtestConfig, RequestResult,
                     StreamError, error_key)


def _has_text(chunk: dict, chat: bool) -> bool:
    for c in chunk.get("choices") or ():
        if ((c.get("delta") or {}).get("content") if chat else c.get("text")):
            return True
    return False


class Progress:
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

    def advance(self, res: RequestResult) -> None:
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


class Runner:
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

    async def one(self, res: RequestResult) -> None:
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
                        raise StreamError(chunk["error"])
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
                  t0: float | None = None) -> tuple[list[RequestResult], float]:
        """`clients` workers send requests `indices` (default: all of them, with cfg.clients), each
        the next one when its last ends, until they are sent or cfg.duration_s from t0 passed."""
        indices = range(self.cfg.requests) if indices is None else indices
        counter = iter(indices)
        results: list[RequestResult] = []
        t0 = time.perf_counter() if t0 is None else t0
        deadline = t0 + self.cfg.duration_s

        async def worker() -> None:
            while True:
                i = next(counter, None)
                left = deadline - time.perf_counter()
                if i is None or left <= 0:
                    return
                res = RequestResult(i)
                results.append(res)
                try:
                    await asyncio.wait_for(self.one(res), left)
                except asyncio.TimeoutError:
                    res.status = "cut"
                except Exception as e:      # every failure is counted and reported, never raised
                    res.status, res.error = "error", error_key(e)
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

    def advance(self, res: RequestResult) -> None:
        with self.counts.get_lock():
            self.counts[0] += 1
            self.counts[1] += res.status == "error"
            self.counts[2] += res.tokens

    async def stop(self) -> None:
        pass


def make_client(cfg: LoadtestConfig):
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
        async with make_client(cfg) as client:
            runner = Runner(cfg, client, model, vocab, chat_words)
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


async def run_processes(cfg: LoadtestConfig, procs: int, model: str, vocab: int | None, chat_words: int,
                         progress: Progress) -> tuple[list[RequestResult], float]:
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
