"""`realizar bench`: llama-bench-like prefill (pp) and decode (tg) speed on any backend.

Random token ids, so a shape twin measures the same as the real model. Each repetition
prefills `prompt_tokens` into a fresh sequence, then decodes `gen_tokens` greedy steps for `batch`
sequences at once, pipelined as the engine runs them (each step's tokens are read back, after the
next step has been started on the device's own argmax). KV blocks come from the engine's block
manager, as in serving; each sequence gets the blocks for all its positions before the clock
starts. Prints a table and optionally writes JSON.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from typing import Any

import numpy as np

from .backends import PrefillItem, create_backend
from .engine.kv_manager import KVManager
from .formats import open_model
from .progress import progress

log = logging.getLogger(__name__)


def _device_info(backend_name: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpu": platform.processor() or platform.machine()}
    if backend_name == "cuda":
        import cupy
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        info.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                    driver=cupy.cuda.runtime.driverGetVersion(), runtime=cupy.cuda.runtime.runtimeGetVersion(),
                    cupy=cupy.__version__)
    return info


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


DECODE_PRIME = 8     # prompt tokens in a slot before its timed decode steps


def run_bench(args) -> int:
    from .model.default import default_model_path
    from .settings import Settings

    path = args.model or str(default_model_path())
    t0 = time.perf_counter()        # load = open (mmap, parse) + backend up (upload, compile, self-check)
    mf = open_model(path)
    batch = max(1, args.batch)
    depth = max(DECODE_PRIME, getattr(args, "depth", 0) or 0)
    ctx = max(args.prompt_tokens, depth) + args.gen_tokens + 1
    settings = Settings.from_env(model=path, backend=args.backend, max_num_seqs=batch + 1, context_length=ctx)
    backend = create_backend(mf, settings)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = mf.config.vocab_size
    kv = KVManager(backend.num_blocks, backend.block_size, prefix_caching=False)   # random ids share nothing

    def take(slot: int, ids: np.ndarray, positions: int) -> None:
        kv.allocate(slot, lambda a, b: ids[a:b], positions)
        backend.set_block_table(slot, kv.table(slot))

    def give_back(slot: int) -> None:
        backend.release(slot)
        kv.free(slot)

    def prefill_once(n: int, slot: int) -> float:
        ids = rng.integers(0, vocab, size=n, dtype=np.int32)
        take(slot, ids, n)
        t = time.perf_counter()
        backend.prefill([PrefillItem(slot, ids, 0)])
        dt = time.perf_counter() - t
        give_back(slot)
        return dt

    def decode_once(steps: int) -> float:
        slots = list(range(batch))
        for s in slots:                      # the context to decode after (--depth; default a short one)
            ids = rng.integers(0, vocab, size=depth, dtype=np.int32)
            take(s, ids, depth + steps + 1)            # +1: the step the last one starts ahead
            for a in range(0, depth, 4096):            # long contexts in chunks, as the engine runs them
                backend.prefill([PrefillItem(s, ids[a:a + 4096], a)])
        toks = rng.integers(0, vocab, size=batch).tolist()
        t = time.perf_counter()
        h = backend.decode_argmax_start(slots, toks, [depth] * batch)
        for _ in range(steps - 1):           # as the engine runs greedy steps: the next one is
            nxt = backend.decode_argmax_start(slots)      # started before this one's tokens are read
            backend.decode_argmax_finish(h)
            h = nxt
        backend.decode_argmax_finish(h)
        dt = time.perf_counter() - t
        for s in slots:
            give_back(s)
        return dt

    prefill_once(max(1, min(32, args.prompt_tokens)), 0)   # warm-up: compilation, graphs, pools
    decode_once(min(4, args.gen_tokens))
    pp, tg = [], []
    with progress(f"bench {mf.name} on {backend.name}", total=args.repetitions, unit="repetitions",
                  log=log) as advance:
        for _ in range(args.repetitions):
            if args.prompt_tokens:
                pp.append(args.prompt_tokens / prefill_once(args.prompt_tokens, 0))
            if args.gen_tokens:
                tg.append(batch * args.gen_tokens / decode_once(args.gen_tokens))
            advance(1)
    stats = backend.stats()
    result = {
        "model": str(mf.path), "name": mf.name, "arch": mf.config.arch, "quant_mix": mf.quant_mix(),
        "backend": backend.name, **_device_info(backend.name),
        "graph_status": stats.get("graph_status", {}),
        "programmatic_launch": stats.get("programmatic_launch", False),
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "batch": batch, "depth": depth,
        "block_size": backend.block_size, "kv_blocks": backend.num_blocks,
        "repetitions": args.repetitions, "load_s": load_s,
        "pp_tok_s": _summary(pp) if pp else None,
        "tg_tok_s": _summary(tg) if tg else None,
        "ms_per_token": (1000.0 * batch / statistics.median(tg)) if tg else None,
        "device_memory_bytes": stats.get("device_memory_bytes", 0),
    }
    backend.close()
    print("| model | backend | batch | test | tok/s (median) | min | max |")
    print("|---|---|---|---|---|---|---|")
    for name, key, n in (("pp", "pp_tok_s", args.prompt_tokens), ("tg", "tg_tok_s", args.gen_tokens)):
        r = result[key]
        if r:
            at = f" @ d{depth}" if name == "tg" and depth > DECODE_PRIME else ""
            print(f"| {mf.name} | {backend.name} | {batch} | {name}{n}{at} | {r['median']:.1f} | "
                  f"{r['min']:.1f} | {r['max']:.1f} |")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
