"""A prompt step of a few tokens on each family of the dispatcher (backends/cuda/dispatch.py): the
GEMVs, the tensor-core kernels on the quantized blocks (MMQ) and the split16 GEMMs, for tuning its
prompt-step thresholds (PROMPT_MMQ_TOKENS, GEMM_MIN_TOKENS). These steps are what the tokens after a
cached prefix, or a short prompt, cost. One slot of the CUDA backend is filled to DEPTH positions,
then a step of T tokens at position DEPTH is timed (backend.prefill: launches or a graph replay, GPU
and the logits copy back, median of --reps) in each family (the dispatcher's prompt_step forced;
steps of every family replay a graph once their shape recurs), in the dispatcher's own choice, and
in that choice launched eagerly (no graph: Forward.prefill_launches after the inputs are in place).
Also the largest logit difference of the MMQ and GEMV steps from the GEMM one (fp32-class paths:
~1e-3 of logits of a few units). Prints a table and writes JSON.

    python benchmarks/prefill_rows_bench.py --model /tmp/twins/qwen15.gguf [--depths 0 4000] [--rows 1 4 8 16 32 64]
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
from realizar_backend.backends.cuda.dispatch import GEMM_ROW_STEP, Step  # noqa: E402
from realizar_backend.formats import open_model  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402


def forced(dispatcher, family: str):
    """A prompt_step for the dispatcher that puts every step in `family` (None where it cannot
    take T tokens: MMQ needs every projection on the tensor cores and at most its largest bucket)."""
    def step(T: int) -> Step | None:
        if family == "gemv":
            return Step("gemv", T)
        if family == "split16":
            return Step("split16", -(-T // GEMM_ROW_STEP) * GEMM_ROW_STEP)
        b = dispatcher.buckets
        return Step("mmq", next(x for x in b if x >= T)) if b and T <= b[-1] else None
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 4000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 17, 32, 64])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = max(args.depths) + max(args.rows) + 16
    s = Settings(model=args.model, backend="cuda", context_length=ctx, max_num_seqs=4, self_check=False)
    be = create_backend(open_model(Path(args.model)), s)
    fwd = be.fwd
    disp = fwd.dispatcher
    auto = disp.prompt_step
    families = {"gemv": forced(disp, "gemv"), "mmq": forced(disp, "mmq"), "gemm": forced(disp, "split16"),
                "auto": auto}
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
            for kind, step in families.items():
                if step(T) is None:
                    continue
                disp.prompt_step = step
                try:
                    for _ in range(2):                    # warm: plans, scratch, cuBLAS, the graph's capture
                        logits[kind] = be.prefill(item)
                    t = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        be.prefill(item)
                        t.append(time.perf_counter() - t0)
                finally:
                    disp.prompt_step = auto
                ms[kind] = statistics.median(t) * 1e3
            chosen = fwd.prompt_step(T)
            replayed = be.prefill(item)                   # and the inputs in place for the eager launches
            t = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                with be.device, be.stream:
                    fwd.max_pos = depth + T - 1
                    fwd.prefill_launches(chosen.rows, 1, chosen.family)
                    be.ws.logits[:1].get()
                t.append(time.perf_counter() - t0)
            ms["eager"] = statistics.median(t) * 1e3
            diff = {"graph_vs_eager": float(np.abs(replayed - be.ws.logits[:1].get()).max())}
            for kind in ("mmq", "gemv"):
                if kind in logits:
                    diff[f"{kind}_vs_gemm"] = float(np.abs(logits[kind] - logits["gemm"]).max())
            out.append(dict(depth=depth, tokens=T, chosen=chosen.family, rows=chosen.rows,
                            **{f"{k}_ms": v for k, v in ms.items()},
                            **{f"max_abs_diff_{k}": v for k, v in diff.items()}))

            def cell(k):
                return f"{ms[k]:.2f}" if k in ms else "-"

            def dcell(k):
                return f"{diff[k]:.2g}" if k in diff else "-"
            rows.append(f"| {depth} | {T} | {cell('gemv')} | {cell('mmq')} | {cell('gemm')} | {cell('auto')} "
                        f"({chosen.family}, {chosen.rows} rows) | {cell('eager')} | {dcell('graph_vs_eager')} | "
                        f"{dcell('mmq_vs_gemm')} | {dcell('gemv_vs_gemm')} |")
    print(f"prompt step (ms, median of {args.reps}; the dispatcher: MMQ from {disp.mmq_min_rows} tokens in buckets "
          f"{list(disp.buckets)}, GEMMs from {disp.gemm_min_tokens} tokens beyond; split weights kept: "
          f"{disp.split16_kept})")
    print("| depth | tokens | GEMV | MMQ | GEMM | default | default, eager | max abs logit diff, graph vs eager "
          "| MMQ vs GEMM | GEMV vs GEMM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(buckets=list(disp.buckets), mmq_min_rows=disp.mmq_min_rows,
                                                   gemm_min_tokens=disp.gemm_min_tokens,
                                                   split16_kept=disp.split16_kept, rows=out), indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
