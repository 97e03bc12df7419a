"""A prefill step of a few tokens, GEMVs against tensor-core projections (MMQ) against GEMMs: what the
tokens after a cached prefix (or a short prompt) cost. One slot of the CUDA backend is filled to DEPTH
positions, then a step of T tokens at position DEPTH is timed (backend.prefill: launches or a graph
replay, GPU and the logits copy back, median of --reps) on each kind of projections (forced through
Forward.prompt_buckets / prompt_mmq_min / gemm_min_tokens: GEMV and MMQ steps replay a graph, GEMM steps
launch eagerly), with the backend's own choice, and that choice launched eagerly (no graph:
Forward.prefill_step after the inputs are in place). Also the largest logit difference of the MMQ and
GEMV steps from the GEMM one (fp32-class paths: ~1e-3 of logits of a few units). Prints a table and
writes JSON.

    python tools/prefill_rows_bench.py --model /tmp/twins/qwen15.gguf [--depths 0 4000] [--rows 1 4 8 16 32 64]
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
from realizar_backend.backends.cuda import forward  # noqa: E402
from realizar_backend.formats import open_model  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 4000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 17, 32, 64])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = max(args.depths) + max(args.rows) + 16
    s = Settings(model=args.model, backend="cuda", context_length=ctx, max_num_seqs=4)
    be = create_backend(open_model(Path(args.model)), s)
    fwd = be.fwd
    auto = (fwd.prompt_buckets, fwd.prompt_mmq_min, fwd.gemm_min_tokens)
    # every step on one kind: (buckets, tensor-core min tokens, GEMM min tokens); MMQ needs a model
    # whose projections all have tensor-core kernels, and at most the largest bucket of rows
    mmq_buckets = forward.prompt_buckets(fwd.mmq.prep_buf.M // 8 * 8 if fwd.mmq is not None else 0)
    mmq_ok = fwd.mmq is not None and fwd.mmq.all_on and bool(mmq_buckets)
    force = {"gemv": ((), 1, 10 ** 9), "mmq": (mmq_buckets, 1, 10 ** 9), "gemm": ((), 1, 1), "auto": auto}
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
            ms, logits = {}, {}
            for kind, (buckets, mmq_min, gemm_min) in force.items():
                if kind == "mmq" and not (mmq_ok and T <= mmq_buckets[-1]):
                    continue
                fwd.prompt_buckets, fwd.prompt_mmq_min, fwd.gemm_min_tokens = buckets, mmq_min, gemm_min
                logits[kind] = be.prefill(item)           # warm: plans, scratch, cuBLAS heuristics, the graph
                t = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    be.prefill(item)
                    t.append(time.perf_counter() - t0)
                ms[kind] = statistics.median(t) * 1e3
            fwd.prompt_buckets, fwd.prompt_mmq_min, fwd.gemm_min_tokens = auto
            chosen = fwd.prompt_step(T)
            replayed = be.prefill(item)                   # and the inputs in place for the eager launches
            t = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                with be.device, be.stream:
                    fwd.prefill_step(T, 1, depth + T - 1)
                    be.ws.logits[:1].get()
                t.append(time.perf_counter() - t0)
            ms["eager"] = statistics.median(t) * 1e3
            diff = {"graph_vs_eager": float(np.abs(replayed - be.ws.logits[:1].get()).max())}
            for kind in ("mmq", "gemv"):
                if kind in logits:
                    diff[f"{kind}_vs_gemm"] = float(np.abs(logits[kind] - logits["gemm"]).max())
            out.append(dict(depth=depth, tokens=T, chosen=chosen[0], rows=chosen[1],
                            **{f"{k}_ms": v for k, v in ms.items()},
                            **{f"max_abs_diff_{k}": v for k, v in diff.items()}))

            def cell(k):
                return f"{ms[k]:.2f}" if k in ms else "-"

            def dcell(k):
                return f"{diff[k]:.2g}" if k in diff else "-"
            rows.append(f"| {depth} | {T} | {cell('gemv')} | {cell('mmq')} | {cell('gemm')} | {cell('auto')} "
                        f"({chosen[0]}, {chosen[1]} rows) | {cell('eager')} | {dcell('graph_vs_eager')} | "
                        f"{dcell('mmq_vs_gemm')} | {dcell('gemv_vs_gemm')} |")
    print(f"prefill step (ms, median of {args.reps}; by default MMQ from {auto[1]} tokens in buckets {list(auto[0])}, "
          f"GEMMs from {auto[2]} tokens beyond; split weights kept: {bool(fwd.gemm.cached)})")
    print("| depth | tokens | GEMV | MMQ | GEMM | default | default, eager | max abs logit diff, graph vs eager "
          "| MMQ vs GEMM | GEMV vs GEMM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(default_buckets=list(auto[0]), default_mmq_min=auto[1],
                                                   default_gemm_min_tokens=auto[2], rows=out), indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
