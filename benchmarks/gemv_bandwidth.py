"""Memory bandwidth of the one-row decode GEMV of every GPU weight type, through the launchers a
decode step uses (ops.mmvf for the quantized types, ops.gemv for the float ones), on one matrix shape
(default 4096 x 14336: an 8B model's down projection). Each type is timed over enough copies of the
matrix that they do not fit in L2 (so the weights come from DRAM, as in a real step), as CUDA-graph
replays; the figure is the matrix's bytes over the time of one launch, against the device's peak
(its memory clock x bus width x 2). Prints a table and writes JSON.

--paths mmvf,mmv8 times each quantized type on both one-row GEMVs the dispatcher can pick (mmvf.cu,
and mmv8.cu for the types it takes: dispatch.MMV8_KERNEL_TYPES) in the same process; --shapes adds the
one-row launches of Qwen2.5-7B and -32B Q4_K_M (QKV with the folded norm, O, the fused gate/up, the
down projections in Q4_K and Q6_K, the 7B LM head with its argmax) on each path.

    python benchmarks/gemv_bandwidth.py [--rows 4096] [--cols 14336] [--types Q4_K,Q6_K] [--json out.json]
    python benchmarks/gemv_bandwidth.py --paths mmvf,mmv8 --shapes --json gemv.json   (old against new)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from realizar_backend.backends.cuda import ops  # noqa: E402
from realizar_backend.backends.cuda.dispatch import MMV8_KERNEL_TYPES  # noqa: E402
from realizar_backend.backends.cuda.matrices import QTYPES, WeightRef  # noqa: E402
from realizar_backend.backends.cuda.modules import get_kernels  # noqa: E402

from mmvf_sweep import graph_us  # noqa: E402

L2_MARGIN = 4          # copies span at least this many times the L2 cache


def peak_bytes_per_s(dev: cupy.cuda.Device) -> float:
    a = dev.attributes
    return a["MemoryClockRate"] * 1e3 * a["GlobalMemoryBusWidth"] / 8 * 2


# (name, kind, [(type, rows)], K): the one-row launches of Qwen2.5-7B (hidden 3584, FFN 18944, 4 KV
# heads of 128, vocab 152064) and -32B (hidden 5120, FFN 27648, 8 KV heads) Q4_K_M; "qkv" and "gate_up"
# with the RMSNorm folded in as the model runs them, "head" with the argmax
SHAPES = [
    ("q7_qkv", "qkv", [(Q.Q4_K, 3584), (Q.Q4_K, 512), (Q.Q6_K, 512)], 3584),
    ("q7_o", "linear", [(Q.Q4_K, 3584)], 3584),
    ("q7_gate_up", "gate_up", [(Q.Q4_K, 18944)], 3584),
    ("q7_down_q4k", "linear", [(Q.Q4_K, 3584)], 18944),
    ("q7_down_q6k", "linear", [(Q.Q6_K, 3584)], 18944),
    ("q7_head", "head", [(Q.Q6_K, 152064)], 3584),
    ("q32_qkv", "qkv", [(Q.Q4_K, 5120), (Q.Q4_K, 1024), (Q.Q6_K, 1024)], 5120),
    ("q32_o", "linear", [(Q.Q4_K, 5120)], 5120),
    ("q32_gate_up", "gate_up", [(Q.Q4_K, 27648)], 5120),
    ("q32_down_q4k", "linear", [(Q.Q4_K, 5120)], 27648),
    ("q32_down_q6k", "linear", [(Q.Q6_K, 5120)], 27648),
]


def _random_rows(qt, nbytes: int, rng) -> cupy.ndarray:
    if QTYPES[qt].blocks:         # random blocks: the speed does not depend on the values
        return rng.integers(0, 256, nbytes, dtype=cupy.uint8)
    # float rows: finite values (NaN/Inf bit patterns are not what a model holds)
    dt = {Q.F32: cupy.float32, Q.F16: cupy.float16, Q.BF16: cupy.float16}[qt]
    return rng.standard_normal(nbytes // np.dtype(dt).itemsize, dtype=cupy.float32).astype(dt)


def _seconds(launch, copies: list, reps: int) -> float:
    """Seconds of one launch(copy), from CUDA-graph replays of a launch per copy (mmvf_sweep.graph_us)."""
    return graph_us(cupy.cuda.Stream(non_blocking=True), copies, launch, reps) / 1e6 / len(copies)


def time_type(k, qt, N: int, K: int, l2: int, reps: int, path: str = "mmvf") -> dict:
    rb = ops.row_bytes(qt, K)
    nbytes = N * rb
    copies = max(2, -(-L2_MARGIN * l2 // nbytes))
    rng = cupy.random.default_rng(int(qt))
    mats = [_random_rows(qt, nbytes, rng) for _ in range(copies)]
    x = cupy.asarray(np.random.default_rng(1).standard_normal(K + 4).astype(np.float32))
    y = cupy.zeros(N + 4, cupy.float32)
    refs = [WeightRef("w", qt, m.data.ptr, N, K, rb) for m in mats]

    def launch(w: WeightRef) -> None:
        if QTYPES[qt].blocks:
            ops.mmvf(k, [(w, 0, y.data.ptr, N)], K, x.data.ptr, K, 1, q8=path == "mmv8")
        else:
            ops.gemv(k, w, x.data.ptr, K, y.data.ptr, N, 1)

    s = _seconds(launch, refs, reps)
    return {"type": qt.name, "path": path, "bytes": nbytes, "copies": copies, "us": s * 1e6, "gb_s": nbytes / s / 1e9}


def time_shape(k, name: str, kind: str, segs, K: int, l2: int, reps: int, path: str) -> dict:
    """One of SHAPES on one path, its weights in enough copies to pass L2."""
    mats = segs * 2 if kind == "gate_up" else segs                       # gate and up
    nbytes = sum(rows * ops.row_bytes(qt, K) for qt, rows in mats)
    copies = max(2, -(-L2_MARGIN * l2 // nbytes))
    rng = cupy.random.default_rng(len(name))
    bufs = [[_random_rows(qt, rows * ops.row_bytes(qt, K), rng) for qt, rows in mats] for _ in range(copies)]
    refs = [[WeightRef("w", qt, b.data.ptr, rows, K, ops.row_bytes(qt, K)) for (qt, rows), b in zip(mats, bb)]
            for bb in bufs]
    x = cupy.asarray(np.random.default_rng(1).standard_normal(K).astype(np.float32))
    nw = cupy.asarray((1.0 + 0.1 * np.random.default_rng(2).standard_normal(K)).astype(np.float32))
    y = cupy.zeros(sum(r for _, r in mats) + 4, cupy.float32)
    key = cupy.zeros(1, cupy.uint64)
    q8 = path == "mmv8"
    norm = (nw.data.ptr, 1e-6) if kind in ("qkv", "gate_up", "head") else None

    def launch(ws) -> None:
        if kind == "gate_up":
            ops.ffn_f(k, ws[0], ws[1], x.data.ptr, K, y.data.ptr, ws[0].rows, 1, 0, norm=norm, q8=q8)
            return
        out, segs_ = 0, []
        for w in ws:
            segs_.append((w, 0, y.data.ptr + 4 * out, w.rows))
            out += w.rows
        ops.mmvf(k, segs_, K, x.data.ptr, K, 1, norm=norm, amax=key.data.ptr if kind == "head" else 0,
                 head=kind == "head", q8=q8)

    s = _seconds(launch, refs, reps)
    return {"shape": name, "path": path, "bytes": nbytes, "copies": copies, "us": s * 1e6, "gb_s": nbytes / s / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--types", default=None, help="comma-separated GGML type names (default: every GPU type)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--paths", default="mmvf", help="one-row GEMVs of the quantized types: mmvf, mmv8 or both")
    ap.add_argument("--shapes", action="store_true", help="also the Qwen2.5-7B / 32B launches (SHAPES)")
    args = ap.parse_args()
    paths = args.paths.split(",")
    dev = cupy.cuda.Device(0)
    peak = peak_bytes_per_s(dev)
    l2 = dev.attributes["L2CacheSize"]
    types = [Q[t] for t in args.types.split(",")] if args.types else list(QTYPES)
    k = get_kernels(0, types)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}: peak {peak / 1e9:,.0f} GB/s, L2 {l2 >> 20} MiB; {args.rows} x {args.cols}, one activation row")
    print(f"{'type':8} {'path':5} {'MB':>8} {'us':>9} {'GB/s':>8} {'of peak':>8}")
    rows = []
    for qt in types:
        for path in paths:
            if path == "mmv8" and qt not in MMV8_KERNEL_TYPES:
                continue
            r = time_type(k, qt, args.rows, args.cols, l2, args.reps, path)
            r["of_peak"] = r["gb_s"] * 1e9 / peak
            rows.append(r)
            print(f"{r['type']:8} {path:5} {r['bytes'] / 1e6:8.1f} {r['us']:9.1f} {r['gb_s']:8.0f} "
                  f"{r['of_peak']:8.0%}")
    shapes = []
    if args.shapes:
        print(f"{'shape':13} {'path':5} {'MB':>8} {'us':>9} {'GB/s':>8} {'of peak':>8}")
        k4m = get_kernels(0, [Q.Q4_K, Q.Q6_K])        # a Q4_K_M model's modules (its quant mask, prebuilt)
        for sname, kind, segs, K in SHAPES:
            for path in paths:
                r = time_shape(k4m, sname, kind, segs, K, l2, args.reps, path)
                r["of_peak"] = r["gb_s"] * 1e9 / peak
                shapes.append(r)
                print(f"{sname:13} {path:5} {r['bytes'] / 1e6:8.1f} {r['us']:9.1f} {r['gb_s']:8.0f} "
                      f"{r['of_peak']:8.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_gb_s": peak / 1e9, "rows": args.rows,
                                               "cols": args.cols, "results": rows, "shapes": shapes}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
