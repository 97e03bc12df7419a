"""A prefill step of a few tokens, GEMVs against GEMMs: what the tokens after a cached prefix (or a
short prompt) cost. One slot of the CUDA backend is filled to DEPTH positions, then a step of T
tokens at position DEPTH is timed (backend.prefill: launches or a graph replay, GPU and the logits
copy back, median of --reps) with the GEMV projections and with the GEMM ones (Forward.gemm_min_tokens
forced), with the backend's own choice, and that choice launched eagerly (no graph: Forward.prefill_step
after the inputs are in place). Prints a table and writes JSON.

    python tools/prefill_rows_bench.py --model /tmp/twins/qwen15.gguf [--depths 0 4000] [--rows 1 2 4 8 16 32]
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

from realizar_backend.backends import PrefillItem, create_backend  # noqa: E402
from realizar_backend.formats import open_model  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 4000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 17, 32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = max(args.depths) + max(args.rows) + 16
    s = Settings(model=args.model, backend="cuda", context_length=ctx, max_num_seqs=4)
    be = create_backend(open_model(Path(args.model)), s)
    fwd = be.fwd
    auto = fwd.gemm_min_tokens
    blocks = be.kv.max_blocks
    be.set_block_table(0, list(range(blocks)))
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 30000, ctx).astype(np.int32)
    for start in range(0, max(args.depths), 512):         # the cached prefix, in the engine's chunks
        be.prefill([PrefillItem(0, prompt[start:min(start + 512, max(args.depths))], start)])
    rows, out = [], []
    for depth in args.depths:
        for T in args.rows:
            item = [PrefillItem(0, prompt[depth:depth + T], depth)]
            ms = {}
            for kind, floor in (("gemv", 10 ** 9), ("gemm", 1), ("auto", auto)):
                fwd.gemm_min_tokens = floor
                be.prefill(item)                          # warm: plans, scratch, cuBLAS heuristics
                t = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    be.prefill(item)
                    t.append(time.perf_counter() - t0)
                ms[kind] = statistics.median(t) * 1e3
            fwd.gemm_min_tokens = auto
            replayed = be.prefill(item)                   # and the inputs in place for the eager launches
            t = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                with be.device, be.stream:
                    fwd.prefill_step(T, 1, depth + T - 1)
                    be.ws.logits[:1].get()
                t.append(time.perf_counter() - t0)
            ms["eager"] = statistics.median(t) * 1e3
            ms["diff"] = float(np.abs(replayed - be.ws.logits[:1].get()).max())   # graph against eager
            out.append(dict(depth=depth, tokens=T, **{f"{k}_ms": v for k, v in ms.items()}))
            rows.append(f"| {depth} | {T} | {ms['gemv']:.2f} | {ms['gemm']:.2f} | {ms['auto']:.2f} | {ms['eager']:.2f} | {ms['diff']:.2g} |")
    print(f"prefill step (ms, median of {args.reps}; GEMMs from {auto} tokens by default, "
          f"split weights kept: {bool(fwd.gemm.cached)})")
    print("| depth | tokens | GEMV | GEMM | default | default, eager | max abs logit diff, graph vs eager |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(default_gemm_min_tokens=auto, rows=out), indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
