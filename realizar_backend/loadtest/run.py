"""`realizar loadtest URL`: find the model, size chat prompts, run the clients, report."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import numpy as np

from ..errors import RealizarError
from .clients import Progress, Runner, make_client, run_processes
from .config import CALIBRATION_ROUNDS, WORDS, LoadtestConfig, RequestResult, error_key
from .report import build_report, format_report, write_requests
from .server_metrics import scrape_metrics, scrape_settled


async def _discover(client, cfg: LoadtestConfig) -> tuple[str, dict]:
    """The model to load (--model, else the first of /v1/models) and its card where listed."""
    try:
        cards = [m.model_dump() for m in (await client.models.list()).data]
    except Exception as e:
        if cfg.model:                        # a server without /v1/models can still be tested
            return cfg.model, {}
        key, msg = error_key(e)
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
            key, msg = error_key(e)
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
    async with make_client(cfg) as client:
        model, card = await _discover(client, cfg)
        context = card.get("max_model_len") or (card.get("meta") or {}).get("n_ctx_train")
        if context and cfg.prompt_tokens + cfg.max_tokens > context:
            raise ValueError(f"--prompt-tokens + --max-tokens ({cfg.prompt_tokens + cfg.max_tokens}) exceed "
                             f"the model's context of {context} tokens")
        chat_words, chat_tokens = 0, None
        if cfg.mode == "chat":
            chat_words, chat_tokens = await _calibrate_chat(client, model, cfg.prompt_tokens, cfg.seed)
        vocab = (card.get("meta") or {}).get("n_vocab")
        runner = Runner(cfg, client, model, vocab, chat_words)
        procs = cfg.process_count
        where = f" in {procs} processes" if procs > 1 else ""
        print(f"loadtest: {cfg.clients} clients{where}, up to {cfg.requests} {cfg.mode} requests or "
              f"{cfg.duration_s:g} s, {cfg.prompt_tokens} prompt + {cfg.max_tokens} new tokens each, model {model!r} at {cfg.root}",
              file=sys.stderr, flush=True)
        before = await scrape_metrics(cfg.root, headers)
        if procs == 1:
            results, elapsed = await runner.run(Progress(cfg.requests))
        else:
            results, elapsed = await run_processes(cfg, procs, model, vocab, chat_words, Progress(cfg.requests))
        if keep is not None:
            keep.extend(results)
    after, settled = await scrape_settled(cfg.root, headers) if before is not None else (None, False)
    return build_report(cfg, model, results, elapsed, before, after, settled, chat_words, chat_tokens)


def run_loadtest(args) -> int:
    cfg = LoadtestConfig(url=args.url, clients=args.clients, requests=args.requests, duration_s=args.duration,
                         prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, model=args.model,
                         api_key=args.api_key, mode=args.mode, random_cancel=args.random_cancel, seed=args.seed,
                         ignore_eos=not args.no_ignore_eos, processes=args.processes)
    cfg.validate()
    results: list[RequestResult] = []
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
