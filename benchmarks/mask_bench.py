"""Host time of a constrained sequence's token masks (llguidance), step by step, with llguidance's
own slices, ours (engine/guidance.py SLICES) and ours with the vocabulary split in
--parts parts (engine/mask_split.py, what the engine does at small batches), on one model's vocabulary.

    python benchmarks/mask_bench.py MODEL.gguf [--schema S.json] [--steps 1000] [--repeats 3] [--parts 4]
                               [--json out.json]

A token stream is drawn once: at each step a uniformly random token among those the grammar allows
(what the bench's random-weight twins do: their greedy draw is an arbitrary allowed token; a
finished object starts over). Each configuration then replays the same stream on one matcher, as
`realizar bench --constrained` at batch 1 does, timing every mask; every mask is checked equal
to the first configuration's. Per step, the minimum over the repeats (the machine's noise out).
Prints the distribution (median, mean, p90, p99, max, share over 0.5 and 1 ms) per configuration,
then the mean by grammar state (inside a string, by its length so far; anything else), then JSON.
The default schema is the bench's (bench.BENCH_SCHEMA).

The split is timed two ways: "split, fill_masks" is Guidance.fill_masks of the one row on
llguidance's threads (max(--parts, cores) of them: on a machine with fewer cores than parts the
parts share them, so this is not the GPU host's figure), and "split, slowest part" times each
part matcher alone, one after the other, and keeps the slowest (the main matcher's where the
grammar forces bytes): what the row costs with a core per part, before the dispatch and the OR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import llguidance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realizar_backend.backends.sampling import allowed_tokens  # noqa: E402
from realizar_backend.bench import BENCH_SCHEMA  # noqa: E402
from realizar_backend.engine.guidance import MASK_PARTS, SLICES, Constraint, Guidance  # noqa: E402
from realizar_backend.engine.mask_split import VocabSplit  # noqa: E402
from realizar_backend.formats import open_model  # noqa: E402
from realizar_backend.model.tokenizer import Tokenizer  # noqa: E402

CONFIGS = {"llguidance's slices": llguidance.LLTokenizer.general_slices(), "ladder (SLICES)": SLICES}


def draw_stream(g: Guidance, c: Constraint, steps: int, seed: int) -> list[list[int]]:
    """Objects of tokens (the last one maybe unfinished), `steps` tokens in all."""
    rng = np.random.default_rng(seed)
    guide, objs, cur = g.guide(c), [], []
    for _ in range(steps):
        tok = int(rng.choice(np.flatnonzero(allowed_tokens(guide.compute_mask(), g.vocab_size))))
        if not guide.consume(tok):
            raise RuntimeError(guide.error)
        cur.append(tok)
        if guide.finished:
            objs.append(cur)
            cur = []
            g.release(guide)
            guide = g.guide(c)
    return objs + ([cur] if cur else [])


STATES = ["outside strings", "string, empty", "string, 1-5 chars", "string, 6-11 chars", "string, 12-17 chars",
          "string, 18-23 chars", "string, 24+ chars"]


def state_label(text: str) -> str:
    """Where a JSON text stops: inside a string (by its length in chars so far) or elsewhere."""
    inside, esc, n = False, False, 0
    for ch in text:
        if inside:
            if esc:
                esc = False
                n += 1
            elif ch == "\\":
                esc = True
            elif ch == '"':
                inside = False
            else:
                n += 1
        elif ch == '"':
            inside, n = True, 0
    if not inside:
        return "outside strings"
    for hi in (0, 5, 11, 17, 23):
        if n <= hi:
            lo = {0: 0, 5: 1, 11: 6, 17: 12, 23: 18}[hi]
            return f"string, {lo}-{hi} chars" if lo != hi else "string, empty"
    return "string, 24+ chars"


def replay(g: Guidance, grammar: str, objs: list[list[int]], repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step: the mask time in ms (minimum over the repeats) and the masks."""
    m = llguidance.LLMatcher(g.ll_tokenizer, grammar, log_level=0)
    mask = np.zeros(g.words, np.int32)
    runs, masks = [], []
    for rep in range(repeats + 1):                 # the first pass warms the lexer's states
        ts = []
        for obj in objs:
            if not m.reset():
                raise RuntimeError(m.get_error())
            for tok in obj:
                t = time.perf_counter()
                m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                ts.append(1000 * (time.perf_counter() - t))
                if rep == 0:
                    masks.append(mask.copy())
                if not m.consume_token(tok):
                    raise RuntimeError(m.get_error())
        if rep:
            runs.append(ts)
    return np.min(runs, axis=0), np.array(masks)


def replay_split(g: Guidance, c: Constraint, objs: list[list[int]], repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the split's fill_masks of one row: its time (minimum over the repeats) and the masks."""
    out = np.zeros((1, g.words), np.int32)
    runs, masks = [], []
    for rep in range(repeats + 1):
        ts = []
        for obj in objs:
            guide = g.guide(c)
            for tok in obj:
                t = time.perf_counter()
                g.fill_masks([guide], out)
                ts.append(1000 * (time.perf_counter() - t))
                if rep == 0:
                    masks.append(out[0].copy())
                if not g.consume_all([guide], [tok])[0]:
                    raise RuntimeError(guide.error)
            g.release(guide)
        if rep:
            runs.append(ts)
    return np.min(runs, axis=0), np.array(masks)


def replay_parts(g: Guidance, split: VocabSplit, grammar: str, objs: list[list[int]], repeats: int) -> np.ndarray:
    """Per step, the slowest part matcher's mask time alone (minimum over the repeats)."""
    main, parts = llguidance.LLMatcher(g.ll_tokenizer, grammar, log_level=0), split.matchers(grammar)
    mask = np.zeros(g.words, np.int32)
    runs = []
    for rep in range(repeats + 1):
        ts = []
        for obj in objs:
            if not (main.reset() and all(p.reset() for p in parts)):
                raise RuntimeError("reset")
            for tok in obj:
                slowest = 0.0
                for m in ([main] if main.compute_ff_bytes() else parts):
                    t = time.perf_counter()
                    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                    slowest = max(slowest, time.perf_counter() - t)
                ts.append(1000 * slowest)
                main.consume_token(tok)
                for k, p in enumerate(parts):
                    p.consume_tokens(split.spell(k, tok))
        if rep:
            runs.append(ts)
    return np.min(runs, axis=0)


def summary(ms: np.ndarray) -> dict:
    return {"median": float(np.median(ms)), "mean": float(ms.mean()), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "max": float(ms.max()),
            "over_0_5ms": float((ms > 0.5).mean()), "over_1ms": float((ms > 1).mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--schema", help="a JSON schema file (default: the bench's)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", type=int, default=MASK_PARTS, help="the split's parts (default: the engine's, "
                                                                   "guidance.MASK_PARTS)")
    ap.add_argument("--json")
    args = ap.parse_args()
    mf = open_model(args.model)
    tok = Tokenizer.from_model_file(mf)
    schema = BENCH_SCHEMA
    if args.schema:
        with open(args.schema) as f:
            schema = json.load(f)
    c = Constraint("json_schema", schema)
    objs = None
    result = {"model": str(mf.path), "vocab": mf.config.vocab_size, "steps": args.steps, "repeats": args.repeats,
              "schema": args.schema or "bench built-in", "configs": {}}
    ref, labels = None, None
    threads = max(args.parts, len(os.sched_getaffinity(0)))
    configs = dict(CONFIGS)
    configs[f"ladder, {args.parts} parts: fill_masks"] = SLICES
    configs[f"ladder, {args.parts} parts: slowest part"] = SLICES
    for name, slices in configs.items():
        split = "parts" in name
        t = time.perf_counter()
        g = Guidance(tok, mf.config.vocab_size, slices=slices, split_parts=args.parts if split else 0,
                     threads=threads)
        g.prewarm()
        build_s = time.perf_counter() - t
        grammar = g.compile(c)
        if objs is None:
            objs = draw_stream(g, c, args.steps, args.seed)
            labels = [state_label(tok.decode(o[:i])) for o in objs for i in range(len(o))]
            result["objects"] = sum(1 for o in objs if o)
        if name.endswith("fill_masks"):
            ms, masks = replay_split(g, c, objs, args.repeats)
        elif name.endswith("slowest part"):
            ms, masks = replay_parts(g, g.build_split(), grammar, objs, args.repeats), ref
        else:
            ms, masks = replay(g, grammar, objs, args.repeats)
        same = True if ref is None else bool((masks == ref).all())
        ref = masks if ref is None else ref
        by_state = {}
        for lab in [x for x in STATES if x in labels]:
            sel = ms[[i for i, x in enumerate(labels) if x == lab]]
            by_state[lab] = {"steps": int(sel.size), "mean": float(sel.mean()), "max": float(sel.max())}
        result["configs"][name] = {"slices": slices, "parts": args.parts if split else 0, "threads": threads,
                                   "tokenizer_build_s": build_s, "masks_equal_to_first": same,
                                   "ms": summary(ms), "by_state": by_state}
    names = list(result["configs"])
    print("| slices | tokenizer build s | median ms | mean | p90 | p99 | max | > 0.5 ms | > 1 ms | masks equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = result["configs"][name]
        s = r["ms"]
        print(f"| {name} | {r['tokenizer_build_s']:.2f} | {s['median']:.3f} | {s['mean']:.3f} | {s['p90']:.3f} | "
              f"{s['p99']:.3f} | {s['max']:.3f} | {100 * s['over_0_5ms']:.1f}% | {100 * s['over_1ms']:.1f}% | "
              f"{r['masks_equal_to_first']} |")
    print()
    print("| state | steps | " + " | ".join(f"{n}: mean / max ms" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for lab, first in result["configs"][names[0]]["by_state"].items():
        cells = " | ".join(f"{result['configs'][n]['by_state'][lab]['mean']:.3f} / "
                           f"{result['configs'][n]['by_state'][lab]['max']:.3f}" for n in names)
        print(f"| {lab} | {first['steps']} | {cells} |")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["masks_equal_to_first"] for r in result["configs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
