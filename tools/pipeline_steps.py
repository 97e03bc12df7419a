"""How often the engine's decode steps start ahead (before the host has read the previous step's
tokens) under a steady load: N clients, each sending requests one after another (so sequences
finish and arrive all the time) with max_tokens drawn from a range, greedy or seeded sampling.
Reads the engine's own counter (stats()["decode_steps"], realizar_decode_steps_total in /metrics).

    python tools/pipeline_steps.py --clients 32 --requests 96            # the default model, CPU
    python tools/pipeline_steps.py --backend cuda --model M.gguf --clients 64 --json

Prints a table (steps by how they started) and, with --json, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realizar_backend.engine.engine import Engine  # noqa: E402
from realizar_backend.engine.sampling import SamplingParams  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402


async def _client(engine: Engine, jobs: list[tuple[list[int], int, int]], done: list[int]) -> None:
    for prompt, max_tokens, seed in jobs:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                **({"temperature": 0.8, "seed": seed} if seed >= 0 else {"temperature": 0.0}))
        async for out in engine.generate(prompt, params):
            done[0] += len(out.token_ids)


def run(args) -> dict:
    settings = Settings(backend=args.backend, model=args.model, max_num_seqs=args.clients,
                        context_length=args.context, pipelined_decode=not args.no_pipeline)
    engine = Engine.from_settings(settings, prewarm_guidance=False)
    rng = random.Random(args.seed)
    vocab = engine.config.vocab_size
    jobs: list[list[tuple[list[int], int, int]]] = [[] for _ in range(args.clients)]
    for i in range(args.requests):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        seed = rng.randrange(1 << 30) if args.sampled else -1
        jobs[i % args.clients].append((prompt, rng.randint(args.min_tokens, args.max_tokens), seed))
    try:
        before = dict(engine.stats()["decode_steps"])
        done = [0]
        t0 = time.perf_counter()

        async def go():
            await asyncio.gather(*[_client(engine, j, done) for j in jobs])
        asyncio.run(go())
        wall = time.perf_counter() - t0
        after = engine.stats()["decode_steps"]
    finally:
        engine.shutdown()
    steps = {k: after[k] - before.get(k, 0) for k in after}
    total = sum(steps.values())
    return {"backend": args.backend, "clients": args.clients, "requests": args.requests,
            "max_tokens": [args.min_tokens, args.max_tokens], "sampled": args.sampled,
            "pipelined": not args.no_pipeline, "decode_steps": steps, "total_steps": total,
            "ahead_fraction": steps.get("ahead", 0) / total if total else 0.0,
            "tokens": done[0], "wall_s": round(wall, 2), "tokens_per_s": round(done[0] / wall, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sampled", action="store_true", help="seeded sampling (temperature 0.8), not greedy")
    ap.add_argument("--no-pipeline", action="store_true", help="REALIZAR_PIPELINED_DECODE off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args)
    print(f"{'start':<10} {'steps':>7} {'share':>7}")
    for k, v in r["decode_steps"].items():
        print(f"{k:<10} {v:>7} {v / max(r['total_steps'], 1):>7.1%}")
    print(f"{'total':<10} {r['total_steps']:>7}   ahead {r['ahead_fraction']:.1%}; {r['tokens']} tokens "
          f"in {r['wall_s']} s ({r['tokens_per_s']} tok/s)")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
