"""Launch-shape sweep of the fp32-activation GEMVs (kernels/mmvf.cu) on the decode shapes of the
qwen15, qwen05, smol135 and gemma270 twins at one batch width (--nb activation rows per launch,
default 1): compile-time variants (rows per warp group, warps per block, loop unroll) x warps per
row, timed as CUDA-graph replays over 28 weight copies (so the weights come from DRAM, as in a real
step, not from L2). Prints a table and writes JSON; a tool for choosing the kernel's defaults
(mmvf.cu's defines, kernels/catalog.py's MMVF_WARPS / MMVF_HEAD_R / FFNF_R, ops.mmvf_wpr).

    python benchmarks/mmvf_sweep.py --json out.json
    python benchmarks/mmvf_sweep.py --policy --variant base: --variant const:FUNIT_BASE_CONST=1
    python benchmarks/mmvf_sweep.py --policy --variant base: --shapes down_q4k,down_q6k --reps 1   (under ncu)
    python benchmarks/mmvf_sweep.py --nb 4 --policy --variant base: --variant U1:MMVF_UNROLL=1

--variant NAME:DEF=V,DEF=V replaces the built-in variants (compile-time defines over the loader's);
--policy times only the launch shape ops.py picks (its warps per row, one resident wave). Every
variant is compiled as the loader compiles (NVRTC through CuPy, the shapes' quant types only, each
kind of launch with the loader's options: the GEMVs, the fused gate/up, the LM head at one row).

mmv8.cu's one-row GEMVs are compared through the launchers a step uses: `gemv_bandwidth.py --paths
mmvf,mmv8 --shapes`, run from copies of the tree whose catalog.py holds each variant's constants (its
kernels rebuilt by tools/build_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cupy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from realizar_backend.backends.cuda.modules import resident_blocks  # noqa: E402
from realizar_backend.backends.cuda.ops import (MMVF_R, ffnf_lanes, mmvf_stride, mmvf_wpr,  # noqa: E402
                                                row_bytes)
from realizar_backend.kernels import catalog  # noqa: E402

LAYERS = 28
# defines over the loader's options (catalog.mmvf_options); "-global": activations read from global
# memory instead of staged in shared memory
VARIANTS = {
    "base-global": {},
    "base": {},
    "U1": {"MMVF_UNROLL": 1},
    "R1": {"MMVF_R": 1},
    "R2": {"MMVF_R": 2},
    "R4": {"MMVF_R": 4},
    "W4": {"MMVF_WARPS": 4},
    "W8": {"MMVF_WARPS": 8},
}
# (name, segments [(qtype, rows)], K, kind); kind "mmvf" or "ffnf"
SHAPES = [
    ("qkv", [(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536, "mmvf"),
    ("o", [(Q.Q4_K, 1536)], 1536, "mmvf"),
    ("gate_up", [(Q.Q4_K, 8960)], 1536, "ffnf"),
    ("down_q4k", [(Q.Q4_K, 1536)], 8960, "mmvf"),
    ("down_q6k", [(Q.Q6_K, 1536)], 8960, "mmvf"),
    ("head", [(Q.Q6_K, 151936)], 1536, "mmvf"),
    # qwen05 (hidden 896: block-32 types)
    ("q05_qkv", [(Q.Q5_0, 896), (Q.Q5_0, 128), (Q.Q8_0, 128)], 896, "mmvf"),
    ("q05_gate_up", [(Q.Q5_0, 4864)], 896, "ffnf"),
    ("q05_down", [(Q.Q6_K, 896)], 4864, "mmvf"),
    ("q05_head", [(Q.Q8_0, 151936)], 896, "mmvf"),
    # the other twins' LM heads (tied Q8_0 embeddings)
    ("smol_head", [(Q.Q8_0, 49152)], 576, "mmvf"),
    ("g270_head", [(Q.Q8_0, 262144)], 640, "mmvf"),
    # Qwen2.5-7B (hidden 3584, FFN 18944, 4 KV heads of 128) and -32B (hidden 5120, FFN 27648, 8 KV heads)
    ("q7_qkv", [(Q.Q4_K, 3584), (Q.Q4_K, 512), (Q.Q6_K, 512)], 3584, "mmvf"),
    ("q7_o", [(Q.Q4_K, 3584)], 3584, "mmvf"),
    ("q7_gate_up", [(Q.Q4_K, 18944)], 3584, "ffnf"),
    ("q7_down_q4k", [(Q.Q4_K, 3584)], 18944, "mmvf"),
    ("q7_down_q6k", [(Q.Q6_K, 3584)], 18944, "mmvf"),
    ("q32_qkv", [(Q.Q4_K, 5120), (Q.Q4_K, 1024), (Q.Q6_K, 1024)], 5120, "mmvf"),
    ("q32_gate_up", [(Q.Q4_K, 27648)], 5120, "ffnf"),
    ("q32_down_q4k", [(Q.Q4_K, 5120)], 27648, "mmvf"),
    ("q32_down_q6k", [(Q.Q6_K, 5120)], 27648, "mmvf"),
]


def graph_us(stream, mats, launch, reps: int) -> float:
    """Microseconds per replay of one CUDA graph that launches `launch(m)` for every m of mats (a
    warm-up outside the capture first: the module loads)."""
    with stream:
        for m in mats:
            launch(m)
        stream.synchronize()
        stream.begin_capture()
        for m in mats:
            launch(m)
        g = stream.end_capture()
        g.launch(stream)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        for _ in range(reps):
            g.launch(stream)
        e1.record(stream)
        e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / reps

def qmask(shapes) -> int:
    """One bit per type of the shapes (a sum would carry where a type repeats and drop types: it
    once compiled Q6_K out)."""
    return sum(1 << int(q) for q in {q for _, segs, _, _ in shapes for q, _ in segs})


def kind_of(shape_name: str, kind: str, nb: int) -> str:
    """The loader's module a shape's launch takes: "ffnf", "head" (the LM head at one row) or "mmvf"."""
    return "head" if kind == "mmvf" and shape_name.endswith("head") and nb == 1 else kind


def loader_defines(kind: str, nb: int) -> dict[str, int]:
    """The -D options the loader gives mmvf.cu for this kind of launch and batch width."""
    opts = catalog.mmvf_options(nb, 2 if kind == "ffnf" else 1, head=kind == "head")
    return {k[2:]: int(v) for k, v in (o.split("=") for o in opts)}


def compile_variant(defines: dict, cc: str, mask: int, kind: str, nb: int = 1) -> tuple[cupy.RawModule, dict]:
    """One kind's kernel with the variant's defines over the loader's, compiled as the loader
    compiles it (NVRTC through CuPy, same options: nvcc gave the same source 222 registers where
    NVRTC gives 128, so an nvcc-built sweep measured kernels that never run); and the defines."""
    defines = {**loader_defines(kind, nb), **defines}
    opts = (*catalog.base_options(cc), f"-DREALIZAR_QMASK={mask:#x}ull", *(f"-D{k}={v}" for k, v in defines.items()))
    mod = cupy.RawModule(code=catalog.source("mmvf.cu"), options=opts)
    _ = mod.get_function(f"{'ffnf' if kind == 'ffnf' else 'mmvf'}_nb{nb}").attributes   # compile and load now
    return mod, defines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variant", action="append", default=[], help="NAME:DEF=V,DEF=V (repeatable)")
    ap.add_argument("--policy", action="store_true", help="only the launch shape ops.py picks")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--nb", type=int, default=1, choices=[1, 2, 4, 8], help="activation rows per launch")
    args = ap.parse_args()
    shapes_run = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    variants = VARIANTS
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, defs = spec.partition(":")
            variants[name] = {k: int(v) for k, v in (d.split("=") for d in defs.split(",") if d)}
    dev = cupy.cuda.Device(0)
    cc = dev.compute_capability
    sms = dev.attributes["MultiProcessorCount"]
    kinds = {kind_of(name, kind, args.nb) for name, _, _, kind in shapes_run}

    def build(d, kind):
        with dev:
            return compile_variant(d, cc, qmask(shapes_run), kind, args.nb)
    with ThreadPoolExecutor(len(variants) * len(kinds)) as ex:
        futs = {(n, kind): ex.submit(build, d, kind) for n, d in variants.items() for kind in kinds}
        modules = {key: f.result() for key, f in futs.items()}
    rng = cupy.random.default_rng(0)
    nb = args.nb
    x = cupy.asarray(np.random.default_rng(1).standard_normal(max(K for _, _, K, _ in shapes_run) * nb).astype(np.float32))
    ybuf = cupy.zeros(151936 * 2 * nb, cupy.float32)
    results = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for shape_name, segs, K, kind in shapes_run:
        layers = 1 if shape_name.endswith("head") else LAYERS
        # weight copies per layer: random bytes (the speed does not depend on the values)
        mat_segs = segs * 2 if kind == "ffnf" else segs          # ffnf: gate and up
        mats = [[rng.integers(0, 256, rows * row_bytes(qt, K), dtype=cupy.uint8) for qt, rows in mat_segs]
                for _ in range(layers)]
        nbytes = sum(m.nbytes for m in mats[0])
        rows_total = sum(r for _, r in segs)
        for vname in variants:
            mod, defines = modules[(vname, kind_of(shape_name, kind, nb))]
            R = defines.get("MMVF_R", MMVF_R)
            W = defines["MMVF_WARPS"]
            fn = mod.get_function(f"ffnf_nb{nb}" if kind == "ffnf" else f"mmvf_nb{nb}")
            stage = 0 if vname.endswith("-global") or nb * mmvf_stride(K) * 4 > 100 * 1024 else 1
            smem = stage * nb * mmvf_stride(K) * 4
            fn.max_dynamic_shared_size_bytes = 100 * 1024
            shapes = [(w, c) for w in (1, 2, 4, 8) for c in (False, True)]
            if args.policy:
                shapes = [(mmvf_wpr(K, rows_total, sms, bool(stage), W), True)]
            for wpr, capped in shapes:
                if wpr > W:
                    continue
                groups = sum(-(-r // R) for _, r in segs)
                # ffnf under --policy: half-warp groups where ops.ffnf_lanes takes them
                lpg = ffnf_lanes(K, wpr, nb) if kind == "ffnf" and args.policy else 32
                gpb = W * (32 // lpg) // wpr
                blocks = (groups + gpb - 1) // gpb
                if capped:        # one resident wave, blocks striding over the groups (ops._max_grid)
                    blocks = min(blocks, max(1, resident_blocks(fn, 32 * W, smem) or 1) * sms)
                grid = (blocks, 1)

                def launch(m):
                    if kind == "ffnf":
                        qt, rows = segs[0]
                        fn(grid, (W * 32,), (np.uint64(m[0].data.ptr), np.uint64(m[1].data.ptr),
                                             np.int64(row_bytes(qt, K)), np.int32(rows), np.int32(K), np.int32(int(qt)),
                                             np.uint64(x.data.ptr), np.int32(K), np.int32(nb), np.int32(0),
                                             np.uint64(ybuf.data.ptr), np.int32(rows), np.int32(wpr),
                                             np.int32(stage), np.uint64(0), np.float32(0), np.int32(lpg)),
                                       shared_mem=smem)
                        return
                    a = []
                    off = 0
                    for (qt, rows), w in zip(segs, m):
                        a += [np.uint64(w.data.ptr), np.int64(row_bytes(qt, K)), np.int32(rows), np.int32(int(qt)),
                              np.uint64(0), np.uint64(ybuf.data.ptr + 4 * off), np.int32(rows)]
                        off += rows
                    for _ in range(3 - len(segs)):
                        a += [np.uint64(0), np.int64(0), np.int32(0), np.int32(0), np.uint64(0), np.uint64(0), np.int32(0)]
                    fn(grid, (W * 32,), (*a, np.int32(K), np.uint64(x.data.ptr), np.int32(K), np.int32(nb),
                                         np.int32(wpr), np.int32(0), np.int32(stage), np.uint64(0), np.float32(0),
                                         np.uint64(0)), shared_mem=smem)

                us = graph_us(stream, mats, launch, args.reps) / layers
                results.append({"shape": shape_name, "variant": vname + ("-cap" if capped else ""), "nb": nb, "wpr": wpr,
                                "grid": grid[0], "regs": int(fn.num_regs),
                                "us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1),
                                "rows": rows_total, "K": K})
        del mats
    report(args, results)
    return 0


def report(args, results: list[dict]) -> None:
    """Prints the table and the best variant per shape; writes --json."""
    best = {}
    print(f"{'shape':10s} {'variant':10s} {'wpr':>3s} {'grid':>6s} {'regs':>4s} {'us':>8s} {'GB/s':>7s}")
    for r in results:
        print(f"{r['shape']:10s} {r['variant']:10s} {r['wpr']:3d} {r['grid']:6d} {r['regs']:4d} {r['us']:8.2f} "
              f"{r['gbps']:7.0f}")
        b = best.get(r["shape"])
        if b is None or r["us"] < b["us"]:
            best[r["shape"]] = r
    print("best per shape:")
    for s, r in best.items():
        print(f"  {s}: {r['variant']} wpr={r['wpr']} {r['us']} us {r['gbps']} GB/s")
    if args.json:
        sms = cupy.cuda.Device(0).attributes["MultiProcessorCount"]
        Path(args.json).write_text(json.dumps({"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                               "sms": sms, "results": results, "best": best}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
