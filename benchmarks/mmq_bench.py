"""Times the batched-decode tensor-core kernels (kernels/mmq.cu, and mmqs.cu where the dispatcher
sends a launch there: prep + mmq / mmq_ffn; at M <= 16 also mmq.cu's tiles, as "tiles") against the
fp32 GEMVs (mmvf.cu: ops.mmvf / ops.ffn_f at the batch's NB variant) on a 1.5B model's decode
shapes (the qwen15 twin's types and shapes, random blocks), for M = 1 .. 256 tokens: the figures
behind the dispatcher's MMQS_MIN_ROWS / MMQ_MIN_ROWS / MMQS_MAX_ROWS (backends/cuda/dispatch.py).

Each figure is one call's time as a CUDA-graph replay: a graph of R calls, each on its own copy of
the weights (copies enough to pass 2x the L2 cache, so the weights come from DRAM as in a real
step), replayed after warm-up, timed with CUDA events, median over the replays. mmq's time includes
its prep launch (as the forward pass would call it: one prep per projection input); prep alone is
listed too. GB/s counts weight bytes; TFLOP/s counts 2 N K M (the useful products). The summary
estimates a qwen15 decode step's projections (28 layers: 14 with Q6_K attn_v/ffn_down, 14 Q4_K)
for both kernels, and the tokens/s those projections alone would allow.

--shapes7b takes a 7B model's shapes instead (the Qwen2.5-7B Q4_K_M twin: hidden 3584, q 3584, k/v
512, FFN 18944, vocab 152064; Q4_K q/k/o/gate/up, Q6_K attn_v and ffn_down on half the layers and
the LM head, Q4_K on the others); --a8 also times mmq.cu's 8-bit-activation variant (MmqPrep(...,
a8=True): its prep + its tiles) beside the fp16 tiles, with the step summary for both.

    python benchmarks/mmq_bench.py [--json out.json] [--ms 1,2,4,8,16,32,64,128,256] [--shapes qkv,o]
                              [--splits 1,2,4,8]    (also time mmq at forced K splits, for tuning)
    python benchmarks/mmq_bench.py --shapes7b --a8 --ms 16,32,64 --no-mmvf
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cupy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from realizar_backend.backends.cuda import dispatch, mmq, ops  # noqa: E402
from realizar_backend.backends.cuda.modules import get_kernels  # noqa: E402
from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight  # noqa: E402

LAYERS = 28
# (name, segments [(qtype, rows)], K, ffn, layers using it in a qwen15 step)
SHAPES = [
    ("qkv", [(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536, False, LAYERS),
    ("o", [(Q.Q4_K, 1536)], 1536, False, LAYERS),
    ("gate_up", [(Q.Q4_K, 8960)], 1536, True, LAYERS),
    ("down_q4k", [(Q.Q4_K, 1536)], 8960, False, LAYERS // 2),
    ("down_q6k", [(Q.Q6_K, 1536)], 8960, False, LAYERS // 2),
    ("head", [(Q.Q6_K, 151936)], 1536, False, 1),
]
# the same for a Qwen2.5-7B Q4_K_M step (28 layers; attn_v and ffn_down Q6_K on half of them)
SHAPES_7B = [
    ("qkv_v6", [(Q.Q4_K, 3584), (Q.Q4_K, 512), (Q.Q6_K, 512)], 3584, False, LAYERS // 2),
    ("qkv_v4", [(Q.Q4_K, 3584), (Q.Q4_K, 512), (Q.Q4_K, 512)], 3584, False, LAYERS // 2),
    ("o", [(Q.Q4_K, 3584)], 3584, False, LAYERS),
    ("gate_up", [(Q.Q4_K, 18944)], 3584, True, LAYERS),
    ("down_q4k", [(Q.Q4_K, 3584)], 18944, False, LAYERS // 2),
    ("down_q6k", [(Q.Q6_K, 3584)], 18944, False, LAYERS // 2),
    ("head", [(Q.Q6_K, 152064)], 3584, False, 1),
]
L2_BYTES = 50 << 20


def median_call_us(launch, copies: int, reps: int) -> float:
    """launch(i): one call on weight copy i. Captured R = copies calls per graph, replayed."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(copies):          # eager once: every module loaded before the capture
            launch(i)
        stream.synchronize()
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        for i in range(copies):
            launch(i)
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        t0, t1 = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(reps):
            t0.record(stream)
            graph.launch(stream)
            t1.record(stream)
            t1.synchronize()
            times.append(cupy.cuda.get_elapsed_time(t0, t1) * 1000.0 / copies)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--splits", default="", help="also time mmq at these forced K splits")
    ap.add_argument("--no-mmvf", action="store_true")
    ap.add_argument("--warps", default="", help="also time mmqs.cu (M <= 16) at these warps per block")
    ap.add_argument("--clusters", default="", help="also time mmqs.cu (M <= 16) at these blocks per cluster")
    ap.add_argument("--shapes7b", action="store_true", help="a Qwen2.5-7B Q4_K_M step's shapes (SHAPES_7B)")
    ap.add_argument("--a8", action="store_true", help="also time the 8-bit-activation variant of mmq.cu")
    args = ap.parse_args()
    table = SHAPES_7B if args.shapes7b else SHAPES
    if args.shapes == ",".join(s[0] for s in SHAPES):
        args.shapes = ",".join(s[0] for s in table)
    ms = [int(m) for m in args.ms.split(",")]
    forced = [int(s) for s in args.splits.split(",") if s]
    warps = [int(w) for w in args.warps.split(",") if w]
    clusters = [int(c) for c in args.clusters.split(",") if c]
    shapes = [s for s in table if s[0] in args.shapes.split(",")]
    qtypes = {q for s in shapes for q, _ in s[1]}

    t0 = time.perf_counter()
    k = get_kernels(0, qtypes=qtypes)
    with ThreadPoolExecutor(8) as ex:                 # mmq's modules compile on first use: all at once
        list(ex.map(lambda key: k.mmq[key], [8, 16, 32, 64, "prep"]))
        if args.a8:
            list(ex.map(lambda key: k.mmq8[key], [8, 16, 32, 64, "prep"]))
        k.mmqs[8]
        list(ex.map(lambda nb: (k.mmvf[nb], k.ffnf[nb]), [1, 2, 4, 8]))
    print(f"kernels ready in {time.perf_counter() - t0:.1f} s on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"{k.sm_count} SMs", file=sys.stderr)

    rng = np.random.default_rng(0)
    M_max = max(ms)
    K_max = max(s[2] for s in shapes)
    prep = mmq.MmqPrep(M_max, K_max)
    prep8 = mmq.MmqPrep(M_max, K_max, a8=True) if args.a8 else None
    scratch = mmq.MmqScratch.for_shapes(M_max, [(K, tuple(n for _, n in segs), ffn) for _, segs, K, ffn, _ in shapes],
                                        k.sm_count, mmq.bn_limits(k, (False, True) if args.a8 else (False,)))
    if forced:
        scratch = mmq.MmqScratch(max(scratch.part.size, 64 << 20), max(scratch.cnt.size, 1 << 16))
    x = cupy.asarray(rng.standard_normal((M_max, K_max)).astype(np.float32))
    results = []
    for name, segs, K, ffn, layers in shapes:
        mats = []                                   # per segment (and gate, up): the weight copies
        for qt, n in (segs * 2 if ffn else segs):
            w, dev = upload_weight(qt, random_weight(qt, n, K, rng))
            mats.append((w, dev))
        wbytes = sum(w.rows * w.row_bytes for w, _ in mats)
        copies = max(1, min(64, -(-2 * L2_BYTES // wbytes)))
        copy_sets = [[w for w, _ in mats]]
        keep = [d for _, d in mats]
        for _ in range(copies - 1):
            ws = []
            for w, dev in mats:
                d2 = dev.copy()
                keep.append(d2)
                ws.append(ops.WeightRef(w.name, w.qtype, d2.data.ptr, w.rows, w.cols, w.row_bytes))
            copy_sets.append(ws)
        rows = [w.rows for w in copy_sets[0][:1 if ffn else None]]
        outs = [cupy.zeros((M_max, n), cupy.float32) for n in rows]
        flops_per_token = 2.0 * sum(w.rows for w in copy_sets[0]) * K
        for M in ms:
            row = {"shape": name, "M": M, "K": K, "rows": rows, "weight_bytes": wbytes, "copies": copies}

            def run_mmq(i, splits=None, M=M, small=None, warps=None, cluster=None, p=prep):
                ws = copy_sets[i]
                mmq.prep(k, x.data.ptr, K_max, M, K, p)     # p: fp16 or (prep8) int8 records
                if ffn:
                    mmq.mmq_ffn(k, ws[0], ws[1], p, M, 0, outs[0].data.ptr, rows[0], scratch, splits=splits,
                                small=small, warps=warps, cluster=cluster)
                else:
                    mmq.mmq(k, [(w, 0, o.data.ptr, n) for w, o, n in zip(ws, outs, rows)], K, p, M, scratch,
                            splits=splits, small=small, warps=warps, cluster=cluster)

            def run_prep(i, M=M):
                mmq.prep(k, x.data.ptr, K_max, M, K, prep)

            def run_mmvf(i, M=M):
                ws = copy_sets[i]
                if ffn:
                    ops.ffn_f(k, ws[0], ws[1], x.data.ptr, K_max, outs[0].data.ptr, rows[0], M, 0)
                else:
                    ops.mmvf(k, [(w, 0, o.data.ptr, n) for w, o, n in zip(ws, outs, rows)], K, x.data.ptr, K_max, M)

            pl = mmq.plan(M, K, tuple(rows), ffn, k.sm_count, bn_max=k.smem.mmq_bn_max())
            row["plan"] = {"bn": pl.bn, "token_tiles": pl.token_tiles, "splits": pl.splits, "grid": pl.grid}
            row["mmq_us"] = median_call_us(run_mmq, copies, args.reps)
            small = M <= dispatch.MMQS_MAX_ROWS and all(dispatch.mmqs_ok(w) for w in copy_sets[0])
            if M > dispatch.MMQS_MAX_ROWS and all(dispatch.mmqs_ok(w) for w in copy_sets[0]):   # both kernels
                row["groups_us"] = median_call_us(lambda i: run_mmq(i, small=True), copies, args.reps)
                row["tile_us"] = median_call_us(lambda i: run_mmq(i, small=False), copies, args.reps)
            if small:         # mmq_us is mmqs.cu's: the tile kernel beside it, and warps per block forced
                row["tile_us"] = median_call_us(lambda i: run_mmq(i, small=False), copies, args.reps)
                for wp in warps:
                    row[f"small_w{wp}_us"] = median_call_us(lambda i, wp=wp: run_mmq(i, warps=wp), copies, args.reps)
                tiles = sum(-(-n // 16) for n in rows) * (-(-M // (8 if M <= 8 else 16)))
                row["cluster"] = mmq.small_cluster(tiles, K, k.sm_count) if mmq.clusters_ok(k) else 1
                for c in clusters:
                    row[f"small_c{c}_us"] = median_call_us(lambda i, c=c: run_mmq(i, cluster=c), copies, args.reps)
            row["prep_us"] = median_call_us(run_prep, min(copies, 16), args.reps)
            a8 = args.a8 and all(w.qtype in dispatch.MMQ8_TYPES for w in copy_sets[0])
            if a8:             # the 8-bit variant (always mmq.cu's tiles), beside the fp16 tiles
                row["mmq8_us"] = median_call_us(lambda i: run_mmq(i, p=prep8), copies, args.reps)
            if not args.no_mmvf:
                row["mmvf_us"] = median_call_us(run_mmvf, copies, args.reps)
            for s in forced:
                row[f"mmq_split{s}_us"] = median_call_us(lambda i, s=s: run_mmq(i, s), copies, args.reps)
            for kind in ("mmq", "mmvf", "mmq8"):
                if f"{kind}_us" in row:
                    t = row[f"{kind}_us"] * 1e-6
                    row[f"{kind}_GBps"] = wbytes / t / 1e9
                    row[f"{kind}_TFLOPs"] = flops_per_token * M / t / 1e12
            row["layers"] = layers
            results.append(row)
            sp = "".join(f"  s{s}={row[f'mmq_split{s}_us']:.1f}" for s in forced)
            if "groups_us" in row:
                sp += f"  [mmqs in groups of 16: {row['groups_us']:.1f}; tiles {row['tile_us']:.1f}]"
            elif "tile_us" in row:
                sp += f"  [mmqs, cluster {row['cluster']}; tiles {row['tile_us']:.1f}]" + "".join(
                    f"  w{wp}={row[f'small_w{wp}_us']:.1f}" for wp in warps) + "".join(
                    f"  c{c}={row[f'small_c{c}_us']:.1f}" for c in clusters)
            mv = (f"{row['mmvf_us']:9.1f} {row['mmvf_GBps']:7.0f} {row['mmq_us'] and row['mmvf_us'] / row['mmq_us']:6.2f}x"
                  if "mmvf_us" in row else "")
            if "mmq8_us" in row:
                sp += (f"  | 8-bit {row['mmq8_us']:8.1f} us {row['mmq8_GBps']:6.0f} GB/s {row['mmq8_TFLOPs']:6.1f} TFLOP/s "
                       f"({row.get('tile_us', row['mmq_us']) / row['mmq8_us']:.2f}x the fp16 tiles)")
            print(f"{name:9s} M={M:4d} bn{pl.bn:<2d}x{pl.token_tiles} split {pl.splits:2d} grid {pl.grid:5d} | "
                  f"mmq {row['mmq_us']:8.1f} us {row['mmq_GBps']:6.0f} GB/s {row['mmq_TFLOPs']:6.1f} TFLOP/s "
                  f"(prep {row['prep_us']:5.1f}) | mmvf {mv}{sp}", flush=True)

    print(f"\n{'7B' if args.shapes7b else 'qwen15'} decode step, projections only (28 layers + head), us and the "
          "tok/s they allow:")
    print(f"{'M':>5} {'mmq us':>10} {'mmvf us':>10} {'8-bit us':>10} {'mmq tok/s':>10} {'mmvf tok/s':>11} "
          f"{'8-bit tok/s':>12}")
    summary = []
    names = {s[0] for s in shapes}
    if names == {s[0] for s in table}:
        for M in ms:
            rs = [r for r in results if r["M"] == M]
            tq = sum(r["mmq_us"] * r["layers"] for r in rs)
            tv = sum(r.get("mmvf_us", 0.0) * r["layers"] for r in rs)
            t8 = sum(r["mmq8_us"] * r["layers"] for r in rs) if all("mmq8_us" in r for r in rs) else 0.0
            summary.append({"M": M, "mmq_us": tq, "mmvf_us": tv, "mmq8_us": t8 or None, "mmq_tok_s": M / tq * 1e6,
                            "mmvf_tok_s": M / tv * 1e6 if tv else None, "mmq8_tok_s": M / t8 * 1e6 if t8 else None})
            print(f"{M:5d} {tq:10.0f} {tv:10.0f} {t8:10.0f} {M / tq * 1e6:10.0f} {M / tv * 1e6 if tv else 0:11.0f} "
                  f"{M / t8 * 1e6 if t8 else 0:12.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "step": summary,
                                               "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
