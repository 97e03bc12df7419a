"""`realizar bench`: llama-bench-like prefill (pp) and decode (tg) speed on any backend.

Random token ids, so a shape twin measures the same as the real model. Each repetition
prefills `prompt_tokens` into a fresh sequence, then decodes `gen_tokens` greedy steps for `batch`
sequences at once, pipelined as the engine runs them (each step's tokens are read back, after the
next step has been started on the device's own argmax). KV blocks come from the engine's block
manager, as in serving; each sequence gets the blocks for all its positions before the clock
starts. With `batch` > 1, each repetition also prefills `batch` prompts together, packed into
steps of up to prefill_chunk_tokens tokens as the engine's scheduler packs arrivals ("pp N xB"):
what a burst of requests costs a server. Prints a table and optionally writes JSON.

`--constrained all|half` adds two decode measurements of the same batch, both run as the engine
runs a batch (the backend's pipelined execute / sample / result; greedy) with the rows' masks
filled in `sample`'s prepare: "no masks" (JSON: tg_sampled), no row constrained (every row plain:
a backend may take its argmax path, as for the engine's), and "constrained", a JSON schema on
every row (all) or every other row (half), each constrained row's mask filled by llguidance while
the step's forward pass runs, after the previous step's token was consumed (the step after it is
started on the device's sampled tokens before they are read; a grammar that completes starts
over: a new object). The table then shows all three, the constrained rate as a fraction of the
plain one, and the host time of the masks per step (hidden behind the forward pass when it is
shorter).
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from typing import Any

import numpy as np

from .backends import GREEDY, PrefillItem, Step, create_backend, run_step
from .backends.base import SampleRow
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
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


DECODE_PRIME = 8     # prompt tokens in a slot before its timed decode steps
# --constrained without --schema: an object with nested objects, enums, arrays and bounded strings
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "verified": {"type": "boolean"}},
                  "required": ["city", "verified"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}


class _Constrained:
    """The engine's constrained decode step, for the bench: rows of `slots` named in `guided`
    follow the schema (fresh guides; a finished one starts over), the rest are plain greedy rows."""

    def __init__(self, guidance, constraint, slots: list[int], guided: set[int]):
        self.guidance, self.constraint = guidance, constraint
        self.guides = {s: guidance.guide(constraint) for s in slots if s in guided}
        self.masks = np.zeros((max(1, len(self.guides)), guidance.words), np.int32)
        order = {s: k for k, s in enumerate(self.guides)}
        self.rows = [SampleRow(temperature=0.0, seed=s, mask=self.masks[order[s]] if s in order else None)
                     for s in slots]
        self.mask_s: list[float] = []
        # host time per step, ms: the launch without the masks, the next step's start, the wait
        # for this step's tokens and the consume
        self.host: dict[str, list[float]] = {"launch": [], "start": [], "wait": [], "consume": []}
        self.restarts = 0

    def fill(self) -> None:
        t = time.perf_counter()
        self.guidance.fill_masks(list(self.guides.values()), self.masks)
        self.mask_s.append(time.perf_counter() - t)

    def consume(self, slots: list[int], tokens) -> None:
        mine = [(s, int(tok)) for s, tok in zip(slots, tokens) if s in self.guides]
        ok = self.guidance.consume_all([self.guides[s] for s, _ in mine], [t for _, t in mine])
        for (s, tok), good in zip(mine, ok):
            g = self.guides[s]
            if not good:
                raise RuntimeError(f"slot {s}: token {tok} broke the grammar: {g.error}")
            if g.finished:
                self.guidance.release(g)
                self.guides[s] = self.guidance.guide(self.constraint)
                self.restarts += 1

    def close(self) -> None:
        """The guides' matchers back to their pool, as the engine returns a finished sequence's."""
        for g in self.guides.values():
            self.guidance.release(g)
        self.guides.clear()


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
        run_step(backend, Step(prompts=[PrefillItem(slot, ids, 0)]), [GREEDY])   # the engine's prompt step: a token back
        dt = time.perf_counter() - t
        give_back(slot)
        return dt

    chunk = settings.prefill_chunk_tokens

    def prefill_packed(n: int) -> float:
        """`batch` prompts of n tokens prefilled as the engine's scheduler packs them: each step's
        prefill call takes prompts (or their chunks) up to prefill_chunk_tokens tokens."""
        prompts = [rng.integers(0, vocab, size=n, dtype=np.int32) for _ in range(batch)]
        for s, ids in enumerate(prompts):
            take(s, ids, n)
        done, s = [0] * batch, 0
        t = time.perf_counter()
        while s < batch:
            items, left = [], chunk
            while s < batch and left:
                m = min(n - done[s], left)
                items.append(PrefillItem(s, prompts[s][done[s]:done[s] + m], done[s]))
                done[s] += m
                left -= m
                s += done[s] == n
            run_step(backend, Step(prompts=items), [GREEDY if done[it.slot] == n else None for it in items])
        dt = time.perf_counter() - t
        for s in range(batch):
            give_back(s)
        return dt

    def decode_once(steps: int, guided: set[int] | None = None) -> float:
        """guided None: the pipelined greedy steps; else the same with those slots constrained, each
        step's masks filled in its sample's prepare."""
        slots = list(range(batch))
        for s in slots:                      # the context to decode after (--depth; default a short one)
            ids = rng.integers(0, vocab, size=depth, dtype=np.int32)
            take(s, ids, depth + steps + 1)            # +1: the step the last one starts ahead
            for a in range(0, depth, 4096):            # long contexts in chunks, as the engine runs them
                run_step(backend, Step(prompts=[PrefillItem(s, ids[a:a + 4096], a)]), [None])
        toks = rng.integers(0, vocab, size=batch).tolist()
        if guided is not None:
            run = _Constrained(guidance, constraint, slots, guided)
            t = time.perf_counter()
            h = backend.execute(Step(slots=slots, tokens=toks, positions=[depth] * batch))
            clock, host = time.perf_counter, run.host
            for i in range(steps):               # as the engine runs sampled steps: the masks are
                ta, n_fill = clock(), len(run.mask_s)
                backend.sample(h, run.rows, run.fill if run.guides else None)
                tb = clock()
                # the next step starts on the device's sampled tokens before this one's are read
                nxt = backend.execute(Step(slots=slots)) if i + 1 < steps else None
                tc = clock()
                tokens = backend.result(h).tokens
                td = clock()
                run.consume(slots, tokens)
                te = clock()
                host["launch"].append(1000 * (tb - ta - sum(run.mask_s[n_fill:])))
                host["start"].append(1000 * (tc - tb))
                host["wait"].append(1000 * (td - tc))
                host["consume"].append(1000 * (te - td))
                h = nxt
            dt = time.perf_counter() - t
            run.close()
            mask_ms.extend(1000 * x for x in run.mask_s)
            if guided:
                for k, xs in run.host.items():
                    host_ms.setdefault(k, []).extend(xs)
            restarts.append(run.restarts)
        else:
            t = time.perf_counter()
            rows = [GREEDY] * batch
            h = backend.execute(Step(slots=slots, tokens=toks, positions=[depth] * batch))
            for _ in range(steps - 1):           # as the engine runs greedy steps: the next one is
                backend.sample(h, rows)          # started before this one's tokens are read
                nxt = backend.execute(Step(slots=slots))
                backend.result(h)
                h = nxt
            backend.sample(h, rows)
            backend.result(h)
            dt = time.perf_counter() - t
        for s in slots:
            give_back(s)
        return dt

    guidance = constraint = None
    guided_slots: set[int] = set()
    mask_ms: list[float] = []
    host_ms: dict[str, list[float]] = {}     # constrained runs' host time per step, by part
    restarts: list[int] = []
    if args.constrained:
        from .engine.guidance import Constraint, Guidance
        from .model.tokenizer import Tokenizer
        schema = BENCH_SCHEMA
        if args.schema:
            with open(args.schema) as f:
                schema = json.load(f)
        guidance = Guidance(Tokenizer.from_model_file(mf), vocab)
        guidance.build_split()     # as in a server that has served constrained rows for a while
        constraint = Constraint("json_schema", schema, param="--schema")
        guidance.compile(constraint)
        guided_slots = set(range(batch)) if args.constrained == "all" else set(range(0, batch, 2))

    # warm-up: compilation, graphs, pools, and the prompt at its full length (prefill_once sends
    # it in one call): a step longer than any before grows the workspace, which drops the captured
    # graphs, so the first timed decode after it would capture them again
    prefill_once(max(1, args.prompt_tokens), 0)
    decode_once(min(4, args.gen_tokens))
    if args.constrained:
        decode_once(min(4, args.gen_tokens), guided_slots)
        mask_ms.clear()
        host_ms.clear()
        restarts.clear()
    pp, pp_packed, tg, tg_sampled, tg_constrained = [], [], [], [], []
    with progress(f"bench {mf.name} on {backend.name}", total=args.repetitions, unit="repetitions",
                  log=log) as advance:
        for _ in range(args.repetitions):
            if args.prompt_tokens:
                pp.append(args.prompt_tokens / prefill_once(args.prompt_tokens, 0))
                if batch > 1:
                    pp_packed.append(batch * args.prompt_tokens / prefill_packed(args.prompt_tokens))
            if args.gen_tokens:
                tg.append(batch * args.gen_tokens / decode_once(args.gen_tokens))
                if args.constrained:
                    tg_sampled.append(batch * args.gen_tokens / decode_once(args.gen_tokens, set()))
                    tg_constrained.append(batch * args.gen_tokens / decode_once(args.gen_tokens, guided_slots))
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
        # batch > 1: the batch's prompts prefilled together, packed as the scheduler packs them
        "pp_packed_tok_s": _summary(pp_packed) if pp_packed else None, "prefill_chunk_tokens": chunk,
        "tg_tok_s": _summary(tg) if tg else None,
        "ms_per_token": (1000.0 * batch / statistics.median(tg)) if tg else None,
        "device_memory_bytes": stats.get("device_memory_bytes", 0),
    }
    if args.constrained:
        result.update({
            "constrained": args.constrained, "constrained_rows": len(guided_slots),
            "schema": args.schema or "built-in",
            "tg_sampled_tok_s": _summary(tg_sampled) if tg_sampled else None,
            "tg_constrained_tok_s": _summary(tg_constrained) if tg_constrained else None,
            "constrained_vs_plain": (statistics.median(tg_constrained) / statistics.median(tg)) if tg else None,
            "mask_ms_per_step": _summary(mask_ms) if mask_ms else None,
            # the rest of the host's step: launch (without the masks), start, wait, consume
            "host_ms_per_step": {k: _summary(xs) for k, xs in host_ms.items() if xs} or None,
            "grammar_restarts_per_run": statistics.median(restarts) if restarts else None,
        })
    backend.close()
    print("| model | backend | batch | test | tok/s (median) | min | max |")
    print("|---|---|---|---|---|---|---|")
    tests = [("pp", "pp_tok_s", args.prompt_tokens),
             ("pp", "pp_packed_tok_s", f"{args.prompt_tokens} x{batch} in {chunk}-token steps"),
             ("tg", "tg_tok_s", args.gen_tokens)]
    if args.constrained:
        tests += [("tg", "tg_sampled_tok_s", f"{args.gen_tokens} no masks"),
                  ("tg", "tg_constrained_tok_s", f"{args.gen_tokens} json schema ({args.constrained} rows)")]
    for name, key, n in tests:
        r = result.get(key)
        if r:
            at = f" @ d{depth}" if name == "tg" and depth > DECODE_PRIME else ""
            print(f"| {mf.name} | {backend.name} | {batch} | {name}{n}{at} | {r['median']:.1f} | "
                  f"{r['min']:.1f} | {r['max']:.1f} |")
    if args.constrained and tg:
        m = result["mask_ms_per_step"]
        print(f"constrained / plain decode: {result['constrained_vs_plain']:.3f}; masks: "
              f"{m['median']:.3f} ms per step (median, max {m['max']:.3f}) on the host" if m else "")
        hm = result["host_ms_per_step"]
        if hm:
            print("host per step, mean ms: " + ", ".join(f"{k} {v['mean']:.3f}" for k, v in hm.items())
                  + (f", masks {m['mean']:.3f}" if m else ""))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
