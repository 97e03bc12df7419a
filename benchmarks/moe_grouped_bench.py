"""Times the routed experts of one MoE layer on the per-pair GEMVs (experts.py expert_pairs, moe.cu)
against the grouped path (experts.py expert_groups: bucketing, mmq.cu's grouped tiles, on fp16 records
and, where the stacks are of dispatch.MMQ8_TYPES, on 8-bit ones: dispatch.MOE_GROUPED_A8) on
Qwen3-30B-A3B's shapes (hidden 2048, expert FFN 768, 128 experts, top 8; Q4_K gate and up, Q6_K
down as in its Q4_K_M file; random blocks and a uniform random routing), at 16, 64 and 512 rows: the
figures that MOE_GROUPED_MIN_ROWS and MOE_GROUPED_A8 (backends/cuda/dispatch.py) are set from.

Each figure is one call's time as a CUDA-graph replay of R calls (the 128 experts' weights, ~340 MB,
pass the L2 cache, so they come from DRAM as in a real step), timed with CUDA events, median over
the replays; the call is the experts alone (the router, top-k and combine are the same launches on
both paths). It also prints both paths' largest difference on the call's output rows, relative to
the largest value (a sanity check, not a parity test: tests/gpu/test_moe.py is), and the 8-bit
records' against the fp16 ones'.

    python benchmarks/moe_grouped_bench.py [--rows 16,64,512] [--types Q4_K,Q4_K,Q6_K] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import cupy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from realizar_backend.backends.cuda import dispatch, mmq  # noqa: E402
from realizar_backend.backends.cuda.experts import GroupedBuffers, expert_groups, expert_pairs  # noqa: E402
from realizar_backend.backends.cuda.modules import get_kernels  # noqa: E402
from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight  # noqa: E402

from mmq_bench import median_call_us  # noqa: E402

H, F, E, TOP = 2048, 768, 128, 8        # Qwen3-30B-A3B: hidden, expert FFN, experts, experts a token
CALLS = 4                               # calls a captured graph replays


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,512")
    ap.add_argument("--types", default="Q4_K,Q4_K,Q6_K", help="gate, up, down storage types")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--bn", type=int, default=None, help="one token-tile height for every row count "
                    "(dispatch.MOE_GROUPED_BN; default: its table)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.bn is not None:
        dispatch.MOE_GROUPED_BN = (args.bn,)
    types = [Q[t] for t in args.types.split(",")]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    k = get_kernels(0, qtypes=set(types))
    mats, keep = [], []
    for qt, (r, c) in zip(types, ((F, H), (F, H), (H, F))):
        w, dev = upload_weight(qt, random_weight(qt, E * r, c, rng))
        mats.append(dataclasses.replace(w, rows=r, experts=E))
        keep.append(dev)
    gate, up, down = mats
    fused = dispatch.same_shape(gate, up)
    print(f"weights up in {time.perf_counter() - t0:.1f} s: {sum(d.nbytes for d in keep) / 2**20:.0f} MiB, "
          f"{'/'.join(q.name for q in types)}")
    results = []
    for T in rows:
        P = T * TOP
        ids = cupy.asarray(np.stack([rng.permutation(E)[:TOP] for _ in range(T)]).astype(np.int32))
        h = cupy.asarray(rng.standard_normal((T, H)).astype(np.float32))
        a = cupy.empty((P, F), cupy.float32)
        y_p = cupy.zeros((P, max(H, 2 * F)), cupy.float32)
        y_g, y_8 = cupy.zeros_like(y_p), cupy.zeros_like(y_p)
        a8 = all(dispatch.mmq8_ok(w) for w in mats)
        buf = GroupedBuffers(T, TOP, E, H, F, mmq.bn_limits(k, (False, True)))
        bn, TB = dispatch.moe_grouped_plan(T, TOP, E, k.smem.mmq_bn_max())

        def pairs(_):
            expert_pairs(k, gate, up, down, ids.data.ptr, TOP, T, h.data.ptr, H, a.data.ptr, y_p.data.ptr,
                         y_p.shape[1], 0, fused)

        def grouped(_):
            expert_groups(k, gate, up, down, ids.data.ptr, TOP, T, h.data.ptr, H, y_g.data.ptr, y_g.shape[1], 0, buf)

        def grouped8(_):
            expert_groups(k, gate, up, down, ids.data.ptr, TOP, T, h.data.ptr, H, y_8.data.ptr, y_8.shape[1], 0, buf,
                          a8=True)

        us_p = median_call_us(pairs, CALLS, args.reps)
        us_g = median_call_us(grouped, CALLS, args.reps)
        us_8 = median_call_us(grouped8, CALLS, args.reps) if a8 else None
        cupy.cuda.Device().synchronize()
        yp, yg, y8 = y_p[:, :H].get(), y_g[:, :H].get(), y_8[:, :H].get()
        top = max(np.max(np.abs(yp)), 1e-30)
        diff = float(np.max(np.abs(yp - yg)) / top)
        diff8 = float(np.max(np.abs(y8 - yg)) / top) if a8 else None
        print(f"rows {T:4d} ({P} pairs, tiles of {bn}, {TB} token tiles): pairs {us_p:9.1f} us  grouped {us_g:9.1f} us"
              f"  ({us_p / us_g:5.2f}x)  max diff {diff:.1e}"
              + (f"  8-bit records {us_8:9.1f} us ({us_g / us_8:5.2f}x fp16's), diff {diff8:.1e}" if a8 else ""))
        results.append({"rows": T, "pairs_us": us_p, "grouped_us": us_g, "grouped_a8_us": us_8, "bn": bn,
                        "token_tiles": TB, "max_diff": diff, "a8_diff": diff8})
    if args.json:
        Path(args.json).write_text(json.dumps({"types": [q.name for q in types], "shape": [H, F, E, TOP],
                                               "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
