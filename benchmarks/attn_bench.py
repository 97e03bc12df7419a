"""Attention kernels on a 1.5B model's shapes (12 q heads, 2 KV heads, head_dim 128): the flash
kernels (kernels/flash_prefill.cu, flash_decode.cu via backends/cuda/flash.py) against attention.cu's
(ops.attention: attn_tile for prompt rows, attn_decode with RoPE and the KV write for decode rows;
the backend's kernels where flash does not take the head size, and for short decode rows), over the
same paged pool. Prints a table and writes JSON: time per launch, K/V GB/s, TFLOP/s, speedup over
attention.cu's.

    python benchmarks/attn_bench.py --json attn.json
    python benchmarks/attn_bench.py --only decode --sweep           (every decode knob combination)
    python benchmarks/attn_bench.py --only decode --defines 'A:-DX=0;B:-DX=1'   (kernel variants side by side)
    python benchmarks/attn_bench.py --only decode --clusters 1,8    (the combine in thread-block clusters)

prefill: one sequence of T tokens at once (T = 512, 4096, 16384), the same 16384 tokens as 32 chunks
  of 512 (each attending to the cached prefix plus itself, as chunked prefill runs them), and the last
  such chunk alone; kernel variants: 4 warps x 2 m-tiles of 16 rows (the default), 4 x 1, 8 x 1,
  4 x 1 with registers capped for 3 blocks per SM, and the default with q as hi + lo fp16.
decode: batch 1, 16, 64 with every row at depth 128, 4096, 16384 (the new token at that position),
  RoPE and the KV write fused, as a decode step runs it: 28 launches (one per layer, each on its own
  pool copy while they fit in 8 GB, so K/V come from DRAM as in a real step) captured in one CUDA
  graph and replayed; the flash kernel at its default knobs and with each knob moved (max splits,
  single-pass limit, keys per split, fp16 q).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import cupy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from realizar_backend.backends.cuda import flash, ops  # noqa: E402
from realizar_backend.backends.cuda.modules import get_kernels  # noqa: E402

H, KVH, D, BS, LAYERS = 12, 2, 128, 16, 28
SCALE, THETA = D ** -0.5, 1e6


def _pool(nblocks: int):
    shape = (nblocks + 1, BS, KVH, D)
    k = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    v = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    return k, v


def _time_graph(launch, reps: int) -> float:
    """Seconds per replay of a graph holding launch()'s kernels (best of 3 batches of reps)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch()                                   # compile, load, warm
        stream.synchronize()
        stream.begin_capture()
        launch()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        best = float("inf")
        for _ in range(3):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            for _ in range(reps):
                graph.launch(stream)
            b.record(stream)
            b.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(a, b) / 1e3 / reps)
    return best


def _regs(fn) -> str:
    return f"{fn.num_regs} regs, {fn.local_size_bytes} B local"


# ---------------------------------------------------------------- prefill

PREFILL_VARIANTS = {"w4m2": {}, "w4m1": {"wm": 1}, "w8m1": {"nw": 8, "wm": 1}, "w4m1-3blk": {"wm": 1, "min_blocks": 3},
                    "w4m2-qhilo": {"qsplit": True}}


def bench_prefill(fk, k, sm: int, reps: int, variants) -> list[dict]:
    rows = []
    T_MAX = 16384
    nb = T_MAX // BS
    kp, vp = _pool(nb)
    bt = cupy.arange(nb, dtype=cupy.int32).reshape(1, nb)
    q = cupy.random.standard_normal((T_MAX, H, D), dtype=cupy.float32)
    out = cupy.empty((T_MAX, H, D), cupy.float32)
    pos_all = cupy.arange(T_MAX, dtype=cupy.int32)
    slots = cupy.zeros(T_MAX, cupy.int32)
    scratch = flash.FlashScratch()
    # (name, [(first position, rows)] launched one after another)
    cases = [(f"prompt {T}", [(0, T)]) for T in (512, 4096, 16384)]
    cases += [("16384 as 32 chunks of 512", [(c * 512, 512) for c in range(32)]),
              ("chunk of 512 at 15872", [(15872, 512)])]
    for name, chunks in cases:
        flops = sum(4 * D * H * (r * p + r * (r + 1) / 2) for p, r in chunks)
        kv_bytes = sum((p + r) * KVH * D * 4 for p, r in chunks)

        def run_classic():
            for p, r in chunks:
                ops.attention(k, q.data.ptr + p * H * D * 4, out.data.ptr,
                              ops.PagedKV(kp.data.ptr, vp.data.ptr, bt.data.ptr, nb, BS.bit_length() - 1),
                              slots.data.ptr, pos_all.data.ptr + p * 4, H, KVH, D, SCALE, 0, r)
        classic = _time_graph(run_classic, max(1, reps // 4))
        for vname, kw in variants.items():
            plans = []
            for p, r in chunks:
                splits = flash.prefill_splits(r, H, p + r, sm, flash.plan_prefill(r, H, D, **kw).rows)
                plans.append((p, r, flash.plan_prefill(r, H, D, splits=splits, **kw)))
            scratch.ensure(*(pl for _, _, pl in plans))

            def run():
                for p, r, pl in plans:
                    flash.prefill(fk, pl, q.data.ptr + p * H * D * 4, out.data.ptr, kp.data.ptr, vp.data.ptr,
                                  bt.data.ptr, nb, BS.bit_length() - 1, slots.data.ptr, pos_all.data.ptr + p * 4, r,
                                  H, KVH, D, SCALE, 0, scratch)
            t = _time_graph(run, reps)
            fn = fk.get(plans[0][2])
            rows.append(dict(kind="prefill", case=name, config=vname, splits=[pl.splits for _, _, pl in plans][-1],
                             us=t * 1e6, gbs=kv_bytes / t / 1e9, tflops=flops / t / 1e12,
                             tok_s=sum(r for _, r in chunks) / t, classic_us=classic * 1e6,
                             speedup=classic / t, regs=_regs(fn)))
            _print(rows[-1])
    return rows


# ---------------------------------------------------------------- decode

def decode_configs(B: int, sm: int, sweep: bool, splits: list[int] | None = None):
    auto = flash.decode_splits(B, KVH, sm)
    base = dict(splits=auto, single_max=256, split_keys=64, qsplit=True)
    if splits:
        for n in splits:
            yield {**base, "splits": n}
        return
    if sweep:
        keys = dict(splits=sorted({max(1, auto // 2), auto, min(flash.MAX_DECODE_SPLITS, 2 * auto)}),
                    single_max=[0, 128, 256, 1024], split_keys=[64, 128, 256], qsplit=[True, False])
        for combo in itertools.product(*keys.values()):
            yield dict(zip(keys, combo))
        return
    yield base
    for knob, values in (("splits", [max(1, auto // 2), min(flash.MAX_DECODE_SPLITS, 2 * auto)]),
                         ("single_max", [0, 1024]), ("split_keys", [128, 256]), ("qsplit", [False])):
        for v in values:
            if v != base[knob]:
                yield {**base, knob: v}


def bench_decode(fk, k, sm: int, reps: int, sweep: bool, batches=(1, 16, 64), depths=(128, 4096, 16384),
                 splits: list[int] | None = None, defines: dict[str, tuple] | None = None,
                 clusters: list[int] | None = None) -> list[dict]:
    rows = []
    for B, depth in itertools.product(batches, depths):
        nb = -(-(depth + 1) // BS)
        pool_bytes = 2 * (B * nb + 1) * BS * KVH * D * 2
        copies = max(1, min(LAYERS, (8 << 30) // pool_bytes))
        pools = [_pool(B * nb) for _ in range(copies)]
        bt = cupy.arange(B * nb, dtype=cupy.int32).reshape(B, nb)      # each row its own blocks
        q = cupy.random.standard_normal((B, H, D), dtype=cupy.float32)
        kin = cupy.random.standard_normal((B, KVH, D), dtype=cupy.float32)
        vin = cupy.random.standard_normal((B, KVH, D), dtype=cupy.float32)
        out = cupy.empty((B, H, D), cupy.float32)
        pos = cupy.full(B, depth, cupy.int32)
        slots = cupy.arange(B, dtype=cupy.int32)
        table = ops.rope_table(depth + 1, D, THETA)
        kv_bytes = LAYERS * B * (depth + 1) * KVH * D * 4
        flops = LAYERS * B * H * (depth + 1) * 4 * D
        name = f"batch {B} depth {depth}"

        def run_classic():
            for i in range(LAYERS):
                kp, vp = pools[i % copies]
                ops.attention(k, q.data.ptr, out.data.ptr,
                              ops.PagedKV(kp.data.ptr, vp.data.ptr, bt.data.ptr, nb, BS.bit_length() - 1),
                              slots.data.ptr, pos.data.ptr, H, KVH, D, SCALE, 0, B,
                              rope=(kin.data.ptr, vin.data.ptr, D, True, table.data.ptr))
        classic = _time_graph(run_classic, reps) / LAYERS
        scratch = flash.FlashScratch()
        for (dname, extra), cfg, cl in itertools.product((defines or {"": ()}).items(),
                                                         decode_configs(B, sm, sweep, splits), clusters or [1]):
            if cl > 1 and cfg["splits"] < cl:
                continue
            cfg = {**cfg, "splits": cfg["splits"] // cl * cl, "cluster": cl}
            plan = flash.plan_decode(B, H, KVH, D, splits=cfg["splits"], qsplit=cfg["qsplit"], cluster=cl)
            if extra:       # a kernel variant: the same entry point built with these defines too
                plan = dataclasses.replace(plan, options=plan.options + extra)
            scratch.ensure(plan)

            def run():
                for i in range(LAYERS):
                    kp, vp = pools[i % copies]
                    flash.decode(fk, plan, q.data.ptr, out.data.ptr, kp.data.ptr, vp.data.ptr, bt.data.ptr, nb,
                                 BS.bit_length() - 1, slots.data.ptr, pos.data.ptr, B, H, KVH, D, SCALE, 0, scratch,
                                 rope=(kin.data.ptr, vin.data.ptr, D, True, table.data.ptr),
                                 single_max=cfg["single_max"], split_keys=cfg["split_keys"])
            t = _time_graph(run, reps) / LAYERS
            config = (f"{dname} " if dname else "") + " ".join(f"{a}={b}" for a, b in cfg.items())
            rows.append(dict(kind="decode", case=name, config=config,
                             **cfg, copies=copies, us=t * 1e6, gbs=kv_bytes / LAYERS / t / 1e9,
                             tflops=flops / LAYERS / t / 1e12, classic_us=classic * 1e6,
                             speedup=classic / t, regs=_regs(fk.get(plan))))
            _print(rows[-1])
        pools = None          # noqa: F841 (frees the copies before the next case allocates)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _print(r: dict) -> None:
    classic = f"{r['classic_us']:10.1f} {r['speedup']:6.2f}x"
    extra = f" {r['tok_s']:10,.0f} tok/s" if "tok_s" in r else ""
    print(f"{r['case']:<28} {r['config']:<52} {r['us']:10.1f} {r['gbs']:8.0f} {r['tflops']:7.1f} {classic}{extra}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--only", choices=["prefill", "decode"], default=None)
    ap.add_argument("--sweep", action="store_true", help="decode: every knob combination")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=",".join(PREFILL_VARIANTS), help="prefill variants, comma-separated")
    ap.add_argument("--batches", default="1,16,64", help="decode batches, comma-separated")
    ap.add_argument("--depths", default="128,4096,16384", help="decode depths, comma-separated")
    ap.add_argument("--splits", default="", help="decode: these max splits (comma-separated) instead of the knobs")
    ap.add_argument("--clusters", default="1", help="decode: splits per thread-block cluster (sm_90), "
                                                     "comma-separated; each config runs at each")
    ap.add_argument("--defines", default="", help="decode kernel variants, 'NAME:-DX=1 -DY=2;NAME2:...' "
                                                    "(each config runs on each variant)")
    args = ap.parse_args()
    ints = lambda v: [int(x) for x in v.split(",") if x]   # noqa: E731
    defines = {n: tuple(o.split()) for n, _, o in (d.partition(":") for d in args.defines.split(";") if d)} or None
    fk = flash.get_flash_kernels(0)
    sm = fk.sm_count
    k = get_kernels(0, head_dim=D)
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{gpu}, {sm} SMs; attention of {H} q heads, {KVH} KV heads, head_dim {D}, blocks of {BS}")
    print(f"{'case':<28} {'config':<52} {'us':>10} {'KV GB/s':>8} {'TFLOP/s':>7} {'attn.cu us':>10} {'speedup':>7}")
    rows = []
    if args.only in (None, "prefill"):
        rows += bench_prefill(fk, k, sm, args.reps, {v: PREFILL_VARIANTS[v] for v in args.variants.split(",")})
    if args.only in (None, "decode"):
        rows += bench_decode(fk, k, sm, args.reps, args.sweep, ints(args.batches), ints(args.depths),
                             ints(args.splits) or None, defines, ints(args.clusters))
    best = {}
    for r in rows:
        key = (r["kind"], r["case"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nfastest per case:")
    for r in best.values():
        _print(r)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "sm_count": sm, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
