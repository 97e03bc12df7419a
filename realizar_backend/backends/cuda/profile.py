"""Per-kernel decode timing with CUDA events (`python -m realizar_backend.backends.cuda.profile
MODEL.gguf`), for docs/perf-notes.md: time and achieved GB/s of every launch of one decode step,
grouped by kernel, plus the replay time of the captured graph per token. `--prefill T`: the same
for a T-token prefill, grouped by launch function.

The step's launches are queued behind a busy-wait kernel, so the events time the GPU's work
and not Python's launch gaps; bytes counted are the fewest each launch must read (weights,
KV rows) and write."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict

import cupy
import numpy as np

from . import ops

log = logging.getLogger(__name__)

_KINDS = ("mmv_q8", "ffn_q8", "mmvf", "ffn_f", "rms_norm_q8", "rms_norm", "rope_kv", "attention", "embed",
          "gemv", "ffn_gate_up", "argmax_rows", "argmax_unpack", "act_mul")


def _bytes(kind: str, args: tuple, kw: dict, cfg, ctx_len: int) -> int:
    if kind == "mmv_q8":
        segs, K, nb = args[1], args[2], args[5]
        return sum(w.rows * w.row_bytes + nb * w.rows * 4 for w, *_ in segs) + nb * (K + K // 8)
    if kind == "ffn_q8":
        wg, nb = args[1], args[5]
        return 2 * wg.rows * wg.row_bytes + nb * (wg.cols + wg.cols // 8 + wg.rows * 5 // 4)
    if kind == "mmvf":
        segs = args[1]
        return sum(w.rows * w.row_bytes for w, *_ in segs)
    if kind == "ffn_f":
        return 2 * args[1].rows * args[1].row_bytes
    if kind in ("gemv", "ffn_gate_up"):
        w = args[1]
        return w.rows * w.row_bytes * (2 if kind == "ffn_gate_up" else 1)
    if kind == "attention":
        n = args[11]
        return n * (2 * ctx_len * cfg.n_kv_heads * cfg.head_dim * 2 + 2 * cfg.q_dim * 4)
    if kind in ("rms_norm_q8", "rms_norm"):
        return cfg.hidden * 4 * 3
    return 0


REPLAYS = 200


def profile_decode(backend, steps: int = 20, ctx_len: int = 64) -> dict:
    """Time each launch of `steps` eager decode steps (batch 1 at position ctx_len) and the graph replay."""
    cfg = backend.config
    k = backend.kernels
    stream = backend.stream
    records: list[tuple[str, int, cupy.cuda.Event]] = []
    originals = {name: getattr(ops, name) for name in _KINDS}
    ctx = {"on": False}

    def wrap(name, fn):
        # one event before each launch; a kernel's time is the gap to the next event (its own
        # run plus one event record, ~1 us)
        def timed(*args, **kw):
            if not ctx["on"]:
                return fn(*args, **kw)
            e0 = cupy.cuda.Event()
            e0.record(stream)
            fn(*args, **kw)
            records.append((name, _bytes(name, args, kw, cfg, ctx_len), e0))
        return timed

    from ...backends.base import PrefillItem
    backend.prefill([PrefillItem(0, np.arange(1, ctx_len + 1, dtype=np.int32) % cfg.vocab_size)])
    backend.decode_argmax([0], [1], [ctx_len])          # captures the graph of bucket 1
    import importlib
    fwd_mod = importlib.import_module(__package__ + ".forward")
    try:
        for name, fn in originals.items():
            setattr(fwd_mod.ops, name, wrap(name, fn))
        per: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
        with backend.device, stream:
            for _ in range(steps):
                backend.ws.dec_io[1, 0] = ctx_len     # each step advances its position (feeds the next): reset
                records.clear()
                k.spin_ns((1,), (1,), (np.int64(20_000_000),))   # 20 ms: all launches queue behind it
                ctx["on"] = True
                backend.fwd.decode_step(1)
                ctx["on"] = False
                end = cupy.cuda.Event()
                end.record(stream)
                stream.synchronize()
                nxt = [r[2] for r in records[1:]] + [end]
                for (name, nbytes, e0), e1 in zip(records, nxt):
                    p = per[name]
                    p[0] += 1
                    p[1] += cupy.cuda.get_elapsed_time(e0, e1) * 1e3
                    p[2] += nbytes
            step_us = sum(p[1] for p in per.values()) / steps
            # the captured graph: replay time per token, GPU only; each replay continues the sequence
            # on the previous one's token (positions ctx_len .. ctx_len + REPLAYS - 1)
            g = backend.graphs.get(1)
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            reps = REPLAYS
            backend.ws.dec_io[1, 0] = ctx_len
            e0.record(stream)
            for _ in range(reps):
                g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            replay_us = cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / reps
    finally:
        for name, fn in originals.items():
            setattr(fwd_mod.ops, name, fn)
    kernels = {}
    for name, (n, us, nbytes) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        kernels[name] = {"launches_per_step": n // steps, "us_per_step": us / steps, "us_per_launch": us / n,
                         "gb_per_s": (nbytes / (us * 1e-6) / 1e9) if nbytes else None,
                         "mb_per_step": nbytes / steps / 1e6}
    return {"steps": steps, "context": ctx_len, "eager_kernel_us_per_step": step_us,
            "graph_replay_us_per_token": replay_us, "kernels": kernels}


_PREFILL_KINDS = ("split_weights", "split_rows", "split_gemm", "unscale_scatter", "unscale_add", "act_split")


def profile_prefill(backend, tokens: int = 512, reps: int = 5) -> dict:
    """Time each launch of a `tokens`-token prefill (one sequence), grouped by function: the split16
    helpers of prefill.py (a split_gemm is its cuBLAS calls) and the ops launches."""
    import importlib
    from ...backends.base import PrefillItem
    pmod = importlib.import_module(__package__ + ".prefill")
    k, stream = backend.kernels, backend.stream
    ids = (np.arange(tokens, dtype=np.int64) * 7919 % backend.config.vocab_size).astype(np.int32)
    backend.prefill([PrefillItem(0, ids)])                 # warm-up: modules, workspace, cuBLAS
    records: list[tuple[str, cupy.cuda.Event]] = []
    on = {"v": False}

    def wrap(name, fn):
        def timed(*args, **kw):
            if on["v"]:
                e0 = cupy.cuda.Event()
                e0.record(stream)
                records.append((name, e0))
            return fn(*args, **kw)
        return timed

    targets = [(pmod, n) for n in _PREFILL_KINDS] + [(ops, n) for n in _KINDS + ("gather_rows", "dequant16",
                                                                                  "gemm", "f32_to_f16")]
    originals = [(m, n, getattr(m, n)) for m, n in targets if hasattr(m, n)]
    per: dict[str, list] = defaultdict(lambda: [0, 0.0])
    walls = []
    try:
        for m, n, fn in originals:
            setattr(m, n, wrap(n, fn))
        with backend.device, stream:
            for _ in range(reps):
                records.clear()
                k.spin_ns((1,), (1,), (np.int64(20_000_000),))
                on["v"] = True
                e_start = cupy.cuda.Event()
                e_start.record(stream)
                backend.prefill([PrefillItem(0, ids)])     # synchronizes on the logits copy
                on["v"] = False
                end = cupy.cuda.Event()
                end.record(stream)
                end.synchronize()
                walls.append(cupy.cuda.get_elapsed_time(e_start, end) * 1e3)
                nxt = [r[1] for r in records[1:]] + [end]
                for (name, e0), e1 in zip(records, nxt):
                    per[name][0] += 1
                    per[name][1] += cupy.cuda.get_elapsed_time(e0, e1) * 1e3
    finally:
        for m, n, fn in originals:
            setattr(m, n, fn)
    kinds = {name: {"calls_per_prefill": c // reps, "us_per_prefill": us / reps}
             for name, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1])}
    gpu_us = sorted(walls)[len(walls) // 2]
    return {"tokens": tokens, "reps": reps, "gpu_us_per_prefill": gpu_us,
            "tok_per_s_gpu": tokens / (gpu_us * 1e-6), "kinds": kinds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--json")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="profile a T-token prefill instead of a decode step")
    ap.add_argument("--ncu", action="store_true",
                    help="run one eager decode step and nothing else (for `ncu` to time each kernel)")
    a = ap.parse_args(argv)
    from ...formats import open_model
    from ...settings import Settings
    from .backend import CUDABackend
    m = open_model(a.model)
    be = CUDABackend(m, max_slots=1, max_context=max(a.context + REPLAYS + 8, a.prefill + 1),
                     settings=Settings.from_env(self_check=False))
    be.set_block_table(0, range(-(-be.max_context // be.block_size)))    # slot 0: the whole context
    if a.ncu:
        be.ws.dec_io[1, 0] = a.context      # attend over `context` (zeroed) cache rows
        with be.device, be.stream:
            be.fwd.decode_step(1)
            be.stream.synchronize()
        be.close()
        return 0
    if a.prefill:
        res = profile_prefill(be, a.prefill)
        be.close()
        print(f"{'function':16s} {'calls':>6s} {'us':>9s} {'share':>6s}")
        for name, r in res["kinds"].items():
            print(f"{name:16s} {r['calls_per_prefill']:6d} {r['us_per_prefill']:9.1f} "
                  f"{r['us_per_prefill'] / res['gpu_us_per_prefill']:6.1%}")
        print(f"prefill of {a.prefill} tokens: {res['gpu_us_per_prefill'] / 1e3:.2f} ms GPU "
              f"({res['tok_per_s_gpu']:.0f} tok/s)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    res = profile_decode(be, ctx_len=a.context)
    res["model"] = a.model
    be.close()
    print(f"{'kernel':14s} {'n/step':>7s} {'us/step':>9s} {'us/launch':>10s} {'GB/s':>8s} {'MB/step':>8s}")
    for name, r in res["kernels"].items():
        gb = f"{r['gb_per_s']:.0f}" if r["gb_per_s"] else "-"
        print(f"{name:14s} {r['launches_per_step']:7d} {r['us_per_step']:9.1f} {r['us_per_launch']:10.2f} {gb:>8s} "
              f"{r['mb_per_step']:8.1f}")
    print(f"eager kernels {res['eager_kernel_us_per_step']:.0f} us/step; graph replay "
          f"{res['graph_replay_us_per_token']:.0f} us/token")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
