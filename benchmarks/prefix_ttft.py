"""Time to first token with and without a cached prefix: one engine (the service's path: Engine ->
scheduler -> KV manager with prefix caching -> backend) gets a prompt of PREFIX random tokens plus a
short tail, then the same prefix with another tail; the second request's prefill should skip the
prefix's blocks. A second engine with `enable_prefix_caching` off answers the second prompt for the
greedy-output comparison. Prints a table and writes JSON, with where the second request's time to
its first token goes (the engine's steps between its arrival and the caller holding the token).

    python benchmarks/prefix_ttft.py --model /tmp/twins/qwen15.gguf --backend cuda --prefix 4000 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from realizar_backend.engine.engine import Engine  # noqa: E402
from realizar_backend.engine.sampling import SamplingParams  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402


class Phases:
    """Times the calls of the engine's step thread (its methods and its backend's, wrapped on these
    instances only) while `on`: (name, start, end), to split a request's time to its first token."""
    CALLS = (("scheduler", ("schedule",)), ("scheduler.kv", ("try_allocate", "commit")),
             ("backend", ("set_block_table", "execute", "sample")), ("backend.prefill_graphs", ("run",)),
             ("", ("_prefill", "_accept", "_flush")))

    def __init__(self, engine: Engine):
        self.on, self.calls, self.breakdown = False, [], {}
        for path, names in self.CALLS:
            obj = engine
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part, None)
            for name in names:
                if obj is not None and hasattr(obj, name):
                    # the prompt step's launches (a graph replay, or eager): "prefill_launch";
                    # the whole prompt step with its first tokens' sampling (its execute and
                    # sample; the tokens are read in sample): "prefill"
                    label = {"run": "prefill_launch", "execute": "prefill", "sample": "prefill"}.get(name, name)
                    setattr(obj, name, self._wrap(label, getattr(obj, name)))

    def _wrap(self, name, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.calls.append((name, t, time.perf_counter()))
        return timed

    def table(self, t0: float, t1: float) -> dict[str, float]:
        """ms per call name between t0 (the request sent) and t1 (its first token at the caller),
        plus the wait before the first schedule() and the delivery after the last flush."""
        seen = [(n, a, b) for n, a, b in list(self.calls) if a >= t0 and b <= t1]
        out: dict[str, float] = {}
        for n, a, b in seen:
            out[n] = out.get(n, 0.0) + (b - a) * 1e3
        first = {n: a for n, a, _ in reversed(seen)}
        last_end = {n: b for n, _, b in seen}
        out["arrival_to_schedule"] = (first.get("schedule", t1) - t0) * 1e3
        if "prefill" in out and "prefill_launch" in out:
            out["prefill_gpu_wait_and_copy"] = out["prefill"] - out["prefill_launch"]
        out["flush_to_caller"] = (t1 - last_end.get("_flush", t1)) * 1e3
        out["ttft"] = (t1 - t0) * 1e3
        return out


def run(engine: Engine, ids: list[int], new: int, phases: Phases | None = None) -> tuple[float, list[int]]:
    """(seconds to the first token, the greedy tokens); phases: timed until the first token."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    if phases is not None:
        phases.calls.clear()
        phases.on = True
    t0 = time.perf_counter()
    ttft, out = None, []
    for o in engine.generate_sync(ids, params):
        if ttft is None and o.token_ids:
            t1 = time.perf_counter()
            ttft = t1 - t0
            if phases is not None:
                phases.on = False
                phases.breakdown = phases.table(t0, t1)
        out += list(o.token_ids)
    return ttft, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--prefix", type=int, default=4000, help="tokens the two prompts share")
    ap.add_argument("--tail", type=int, default=16, help="tokens after the prefix, different per prompt")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens generated per request")
    ap.add_argument("--repeat", type=int, default=3, help="pairs of requests, each on a new prefix (medians)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = args.prefix + args.tail + args.new + 64
    rng = np.random.default_rng(0)
    # ids every twin's vocabulary has
    prefixes = [[int(t) for t in rng.integers(100, 30000, args.prefix)] for _ in range(args.repeat)]
    tails = [[int(t) for t in rng.integers(100, 30000, args.tail)] for _ in range(2)]
    rows = {}
    for cache in (True, False):
        eng = Engine.from_settings(Settings(model=args.model, backend=args.backend, context_length=ctx,
                                            max_num_seqs=4, enable_prefix_caching=cache))
        # warm-up on another prefix of the same length: graphs, the deep-chunk attention variants
        # and the allocator, so that both timed requests run on a warm engine
        warm = [int(t) for t in rng.integers(100, 30000, args.prefix)]
        run(eng, warm + tails[0], 2)
        run(eng, warm + tails[1], 2)
        phases = Phases(eng)
        reps = []
        for prefix in prefixes:
            first = run(eng, prefix + tails[0], args.new) if cache else None
            second = run(eng, prefix + tails[1], args.new, phases)
            reps.append(dict(first_ttft_s=first and first[0], second_ttft_s=second[0], second_tokens=second[1],
                             second_phases_ms=phases.breakdown))
        rows[cache] = dict(reps=reps, hit_tokens=eng.stats().get("prefix_cache_hit_tokens"))
        eng.shutdown()
    on, off = rows[True], rows[False]
    med = statistics.median
    first_s = med(r["first_ttft_s"] for r in on["reps"])
    second_s = med(r["second_ttft_s"] for r in on["reps"])
    off_s = med(r["second_ttft_s"] for r in off["reps"])
    ratios = [r["second_ttft_s"] / r["first_ttft_s"] for r in on["reps"]]
    ratio = med(ratios)
    same = all(a["second_tokens"] == b["second_tokens"] for a, b in zip(on["reps"], off["reps"]))
    print(f"medians of {args.repeat} pairs (ratios: {', '.join(f'{r:.3f}' for r in ratios)})")
    print("| prefix | first TTFT ms | second TTFT ms | ratio | cache-off TTFT ms | hit tokens | greedy equal |")
    print(f"| {args.prefix} | {first_s * 1e3:.1f} | {second_s * 1e3:.1f} | {ratio:.3f} | "
          f"{off_s * 1e3:.1f} | {on['hit_tokens']} | {same} |")
    print("second request, ms from its arrival to its first token at the caller (median; cache on / off):")
    names = list(dict.fromkeys(n for r in on["reps"] + off["reps"] for n in r["second_phases_ms"] if n != "ttft"))
    for n in names + ["ttft"]:
        a = med(r["second_phases_ms"].get(n, 0.0) for r in on["reps"])
        b = med(r["second_phases_ms"].get(n, 0.0) for r in off["reps"])
        print(f"  {n:28s} {a:9.3f} {b:9.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(prefix=args.prefix, tail=args.tail, cache_on=on, cache_off=off,
                                                   first_ttft_s=first_s, second_ttft_s=second_s, ratio=ratio,
                                                   greedy_equal=same), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
