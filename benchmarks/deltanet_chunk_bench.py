"""Times one Gated DeltaNet layer's delta rule (ops.dn_delta: deltanet.cu) over a prompt segment token
by token (chunk_min None) against the chunked rule (dn_chunk_k<dk> over the segment's whole chunks,
then dn_delta_k<dk> over the rest) at several chunk_min, on Qwen3.5/3.6 head shapes (random inputs,
one segment from position 0 on a live slot), at several segment lengths: the figures that
dispatch.DN_CHUNK_MIN_TOKENS is to be set from (the rule pays where the chunked pair is faster on a
segment of that many rows).

Each figure is one call's time as a CUDA-graph replay of CALLS calls, timed with CUDA events, median
over the replays (benchmarks/mmq_bench.py median_call_us). It also prints the largest difference of
the chunked outputs from the token-by-token ones, relative to the largest value (a sanity check; the
parity tests are tests/gpu/test_hybrid_gpu.py's).

    python benchmarks/deltanet_chunk_bench.py [--shape qwen36-27b] [--tokens 64,256,1024,4096]
        [--chunk-min 64] [--json out.json]
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

from realizar_backend.backends.cuda import ops  # noqa: E402
from realizar_backend.backends.cuda.modules import get_kernels  # noqa: E402

from mmq_bench import median_call_us  # noqa: E402

# (key heads, k_dim, value heads, v_dim, DeltaNet layers of the model)
SHAPES = {"qwen36-27b": (16, 128, 48, 128, 48), "qwen3-next": (16, 128, 32, 128, 36)}
CALLS = 4                               # calls a captured graph replays
SLOTS = 2                               # the state's slots; slot SLOTS is the scratch slot


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen36-27b", choices=list(SHAPES))
    ap.add_argument("--tokens", default="64,256,1024,4096")
    ap.add_argument("--chunk-min", default="64", help="chunk_min values to time against None")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nk, dk, nv, dv, layers = SHAPES[args.shape]
    rules = [int(c) for c in args.chunk_min.split(",")]
    rng = np.random.default_rng(0)
    k = get_kernels(0)
    C = 2 * nk * dk + nv * dv
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        cv = cupy.asarray((rng.standard_normal((T, C)) * 0.7).astype(np.float32))
        alpha, beta = (cupy.asarray(rng.standard_normal((T, nv)).astype(np.float32)) for _ in range(2))
        z = cupy.asarray(rng.standard_normal((T, nv * dv)).astype(np.float32))
        a_coef = cupy.asarray((-np.exp(rng.uniform(-2, 1, nv))).astype(np.float32))
        dt_bias = cupy.asarray(rng.uniform(-1, 1, nv).astype(np.float32))
        out_norm = cupy.asarray(rng.uniform(0.5, 1.5, dv).astype(np.float32))
        state = cupy.zeros((SLOTS, nv, dk, dv), cupy.float32)
        slots = cupy.zeros(T, cupy.int32)
        pos = cupy.arange(T, dtype=cupy.int32)
        rows = ops.StepRows(slots.data.ptr, pos.data.ptr, SLOTS, T)
        outs = {}

        def call(rule):
            out = outs.setdefault(rule, cupy.empty((T, nv * dv), cupy.float32))
            return lambda _: ops.dn_delta(k, cv.data.ptr, C, alpha.data.ptr, beta.data.ptr, nv, z.data.ptr, nv * dv,
                                          a_coef.data.ptr, dt_bias.data.ptr, out_norm.data.ptr, state.data.ptr, rows,
                                          nk, dk, nv, dv, 1e-6, out.data.ptr, nv * dv, chunk_min=rule)
        us = {rule: median_call_us(call(rule), CALLS, args.reps) for rule in [None, *rules]}
        cupy.cuda.Device().synchronize()
        ref = outs[None].get()
        line = f"{args.shape} {T:5d} tokens: token by token {us[None]:9.1f} us"
        row = {"tokens": T, "serial_us": us[None], "chunked": []}
        for rule in rules:
            diff = float(np.max(np.abs(outs[rule].get() - ref)) / max(np.max(np.abs(ref)), 1e-30))
            line += f" | chunk_min {rule}: {us[rule]:9.1f} us ({us[None] / us[rule]:5.2f}x, max diff {diff:.1e})"
            row["chunked"].append({"chunk_min": rule, "us": us[rule], "max_diff": diff})
        print(line + f"  [x{layers} layers: {us[None] * layers / 1000:.1f} ms token by token]")
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [nk, dk, nv, dv], "layers": layers,
                                               "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
