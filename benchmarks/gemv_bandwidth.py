"""Memory bandwidth of the one-row decode GEMV of every GPU weight type, through the launchers a
decode step uses (ops.mmvf for the quantized types, ops.gemv for the float ones), on one matrix shape
(default 4096 x 14336: an 8B model's down projection). Each type is timed over enough copies of the
matrix that they do not fit in L2 (so the weights come from DRAM, as in a real step), as CUDA-graph
replays; the figure is the matrix's bytes over the time of one launch, against the device's peak
(its memory clock x bus width x 2). Prints a table and writes JSON.

    python benchmarks/gemv_bandwidth.py [--rows 4096] [--cols 14336] [--types Q4_K,Q6_K] [--json out.json]
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
from realizar_backend.backends.cuda.matrices import QTYPES, WeightRef  # noqa: E402
from realizar_backend.backends.cuda.modules import get_kernels  # noqa: E402

L2_MARGIN = 4          # copies span at least this many times the L2 cache


def peak_bytes_per_s(dev: cupy.cuda.Device) -> float:
    a = dev.attributes
    return a["MemoryClockRate"] * 1e3 * a["GlobalMemoryBusWidth"] / 8 * 2


def time_type(k, qt, N: int, K: int, l2: int, reps: int) -> dict:
    rb = ops.row_bytes(qt, K)
    nbytes = N * rb
    copies = max(2, -(-L2_MARGIN * l2 // nbytes))
    rng = cupy.random.default_rng(int(qt))
    if QTYPES[qt].blocks:
        # random blocks: the speed does not depend on the values
        mats = [rng.integers(0, 256, nbytes, dtype=cupy.uint8) for _ in range(copies)]
    else:                        # float rows: finite values (NaN/Inf bit patterns are not what a model holds)
        dt = {Q.F32: cupy.float32, Q.F16: cupy.float16, Q.BF16: cupy.float16}[qt]
        mats = [rng.standard_normal(nbytes // np.dtype(dt).itemsize, dtype=cupy.float32).astype(dt) for _ in range(copies)]
    x = cupy.asarray(np.random.default_rng(1).standard_normal(K + 4).astype(np.float32))
    y = cupy.zeros(N + 4, cupy.float32)
    refs = [WeightRef("w", qt, m.data.ptr, N, K, rb) for m in mats]

    def launch(w: WeightRef) -> None:
        if QTYPES[qt].blocks:
            ops.mmvf(k, [(w, 0, y.data.ptr, N)], K, x.data.ptr, K, 1)
        else:
            ops.gemv(k, w, x.data.ptr, K, y.data.ptr, N, 1)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for w in refs:
            launch(w)                     # module load and first-use compiles outside the capture
        stream.synchronize()
        stream.begin_capture()
        for w in refs:
            launch(w)
        g = stream.end_capture()
        g.launch(stream)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        for _ in range(reps):
            g.launch(stream)
        e1.record(stream)
        e1.synchronize()
    s = cupy.cuda.get_elapsed_time(e0, e1) / 1e3 / (reps * copies)
    return {"type": qt.name, "bytes": nbytes, "copies": copies, "us": s * 1e6, "gb_s": nbytes / s / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--types", default=None, help="comma-separated GGML type names (default: every GPU type)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = cupy.cuda.Device(0)
    peak = peak_bytes_per_s(dev)
    l2 = dev.attributes["L2CacheSize"]
    types = [Q[t] for t in args.types.split(",")] if args.types else list(QTYPES)
    k = get_kernels(0, types)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}: peak {peak / 1e9:,.0f} GB/s, L2 {l2 >> 20} MiB; {args.rows} x {args.cols}, one activation row")
    print(f"{'type':8} {'MB':>8} {'us':>9} {'GB/s':>8} {'of peak':>8}")
    rows = []
    for qt in types:
        r = time_type(k, qt, args.rows, args.cols, l2, args.reps)
        r["of_peak"] = r["gb_s"] * 1e9 / peak
        rows.append(r)
        print(f"{r['type']:8} {r['bytes'] / 1e6:8.1f} {r['us']:9.1f} {r['gb_s']:8.0f} {r['of_peak']:8.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_gb_s": peak / 1e9, "rows": args.rows,
                                               "cols": args.cols, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
