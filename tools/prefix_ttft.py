"""Time to first token with and without a cached prefix: one engine (the service's path: Engine ->
scheduler -> KV manager with prefix caching -> backend) gets a prompt of PREFIX random tokens plus a
short tail, then the same prefix with another tail; the second request's prefill should skip the
prefix's blocks. A second engine with `enable_prefix_caching` off answers the second prompt for the
greedy-output comparison. Prints a table and writes JSON.

    python tools/prefix_ttft.py --model /tmp/twins/qwen15.gguf --backend cuda --prefix 4000 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from realizar_backend.engine.engine import Engine  # noqa: E402
from realizar_backend.engine.sampling import SamplingParams  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402


def run(engine: Engine, ids: list[int], new: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the greedy tokens)."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    ttft, out = None, []
    for o in engine.generate_sync(ids, params):
        if ttft is None and o.token_ids:
            ttft = time.perf_counter() - t0
        out += list(o.token_ids)
    return ttft, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--prefix", type=int, default=4000, help="tokens the two prompts share")
    ap.add_argument("--tail", type=int, default=16, help="tokens after the prefix, different per prompt")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens generated per request")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = args.prefix + args.tail + args.new + 64
    rng = np.random.default_rng(0)
    prefix = [int(t) for t in rng.integers(100, 30000, args.prefix)]       # ids every twin's vocabulary has
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
        first = run(eng, prefix + tails[0], args.new) if cache else None
        second = run(eng, prefix + tails[1], args.new)
        rows[cache] = dict(first_ttft_s=first and first[0], second_ttft_s=second[0], second_tokens=second[1],
                           hit_tokens=eng.stats().get("prefix_cache_hit_tokens"))
        eng.shutdown()
    on, off = rows[True], rows[False]
    ratio = on["second_ttft_s"] / on["first_ttft_s"]
    same = on["second_tokens"] == off["second_tokens"]
    print(f"| prefix | first TTFT ms | second TTFT ms | ratio | cache-off TTFT ms | hit tokens | greedy equal |")
    print(f"| {args.prefix} | {on['first_ttft_s'] * 1e3:.1f} | {on['second_ttft_s'] * 1e3:.1f} | {ratio:.3f} | "
          f"{off['second_ttft_s'] * 1e3:.1f} | {on['hit_tokens']} | {same} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(prefix=args.prefix, tail=args.tail, cache_on=on, cache_off=off,
                                                   ratio=ratio, greedy_equal=same), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
