"""Per-kernel time of one GPU step: every launch of a decode step of B rows (or, with --prefill T, a
prompt step of T tokens) timed with CUDA events, grouped by launcher and matrix, with the bytes it
must at least read (weights, split weights, K/V rows) and the GB/s that makes; for decode also the
captured graph's replay time per step.

    python benchmarks/decode_profile.py MODEL.gguf [--batch 1] [--context 64] [--json out.json]
    python benchmarks/decode_profile.py MODEL.gguf --prefill 512
    python benchmarks/decode_profile.py MODEL.gguf --ncu      (one eager decode step and nothing else)
    ncu --profile-from-start off ... decode_profile.py MODEL.gguf --ncu   (that step's launches only: the
        profiler runs from its start to its end, not over the load and the warm-up step)

The step's launches queue behind a busy-wait kernel, so the events time the GPU's work and not
Python's launch gaps; a launch's time is the gap to the next event (its own run plus one event
record). They run as plain launches one after another: what programmatic dependent launch overlaps
in a captured step shows in the replay time, not in the rows. A row is a launcher function of the
backend (ops.mmvf, linear.mmq, flash.decode, split16.split_gemm, ...) and the matrices it
multiplies ("ops.mmvf attn_q+attn_k+attn_v"); the dispatcher (backends/cuda/dispatch.py) decides which
launcher a matrix gets.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the functions that launch kernels, by module: the forward pass calls each through its module's
# attribute (ops.mmvf, flash.decode, split16.split_gemm; linear.py's own names for mmq.py's)
LAUNCHERS = {
    "ops": ("embed", "rms_norm", "rope_kv", "attention", "gemv", "mmvf", "ffn_f", "ffn_gate_up", "act_mul",
            "gather_rows", "argmax_unpack", "argmax_rows",
            # a mixture of experts' router top-k, per-pair GEMVs, grouped buckets and combine; a hybrid's
            # Gated DeltaNet
            "moe_topk", "moe_gate_up", "moe_gemv", "moe8", "moe8_down_combine", "moe_combine", "moe_bucket",
            "moe_shared_add",
            "split_pair", "sigmoid_mul", "dn_conv", "dn_delta", "add_rows", "dequant"),
    "linear": ("prep", "mmq", "mmq_ffn"),
    # the grouped experts' own calls (experts.py reaches them through the mmq module)
    "mmq": ("prep", "mmq_moe"),
    "flash": ("prefill", "decode"),
    "split16": ("split_weights", "split_rows", "act_split", "unscale_scatter", "unscale_add", "split_gemm"),
}
REPLAYS = 200
SPIN_NS = 20_000_000          # the busy-wait the launches queue behind: longer than any step's launching


def _matrices(args: tuple, kw: dict) -> list:
    """The WeightRefs a launcher's arguments name (alone, in segments (w, bias, y, ys), in tuples)."""
    from realizar_backend.backends.cuda.matrices import WeightRef
    out = []
    for a in (*args, *kw.values()):
        if isinstance(a, WeightRef):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, WeightRef):
                    out.append(x)
                elif isinstance(x, tuple) and x and isinstance(x[0], WeightRef):
                    out.append(x[0])
    return out


def _role(name: str) -> str:
    return re.sub(r"\.weight$", "", re.sub(r"^blk\.\d+\.", "", name))


def _label_bytes(fn: str, args: tuple, kw: dict, cfg, keys: int) -> tuple[str, int]:
    """A launch's row label and the bytes it must at least read."""
    mats = _matrices(args, kw)
    roles = "+".join(dict.fromkeys(_role(w.name) for w in mats))
    label = f"{fn} {roles}" if roles else fn
    if fn == "ops.embed":
        return label, 0                        # reads only the tokens' rows
    if fn == "split16.split_gemm":             # (w, x, N, K, T, y, ldy, calls, layout): the weights, 2 or 4 bytes each
        from realizar_backend.backends.cuda.split16 import LAYOUT_FP16, LAYOUT_SPLIT
        layout = kw.get("layout", args[8] if len(args) > 8 else LAYOUT_SPLIT)
        return label, (2 if layout == LAYOUT_FP16 else 4) * int(args[2]) * int(args[3])
    if fn in ("ops.attention", "flash.decode") and keys:
        # K and V (fp16) of every key of every row (ops.attention's and flash.decode's 12th argument),
        # each KV head once
        return label, int(args[11]) * keys * cfg.n_kv_heads * cfg.head_dim * 2 * 2
    return label, sum(w.rows * w.row_bytes for w in mats)


class Recorder:
    """Wraps the launchers; while `on`, records an event before each launch with its label."""

    def __init__(self, stream, cfg):
        import importlib
        self.stream, self.cfg, self.on, self.keys = stream, cfg, False, 0
        self.records: list[tuple[str, int, object]] = []
        self._saved = []
        for mod, names in LAUNCHERS.items():
            m = importlib.import_module(f"realizar_backend.backends.cuda.{mod}")
            for n in names:
                fn = getattr(m, n)
                self._saved.append((m, n, fn))
                setattr(m, n, self._wrap(f"{mod}.{n}", fn))

    def _wrap(self, name, fn):
        import cupy

        def timed(*args, **kw):
            if self.on:
                label, nbytes = _label_bytes(name, args, kw, self.cfg, self.keys)
                e0 = cupy.cuda.Event()
                e0.record(self.stream)
                self.records.append((label, nbytes, e0))
            return fn(*args, **kw)
        return timed

    def restore(self) -> None:
        for m, n, fn in self._saved:
            setattr(m, n, fn)

    def timed(self, k, launch) -> dict[str, list]:
        """launch()'s launches, queued behind a busy-wait: label -> [launches, us, bytes]."""
        import cupy
        self.records.clear()
        k.spin_ns((1,), (1,), (np.int64(SPIN_NS),))
        self.on = True
        try:
            launch()
        finally:
            self.on = False
        end = cupy.cuda.Event()
        end.record(self.stream)
        end.synchronize()
        per: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
        nxt = [r[2] for r in self.records[1:]] + [end]
        for (label, nbytes, e0), e1 in zip(self.records, nxt):
            p = per[label]
            p[0] += 1
            p[1] += cupy.cuda.get_elapsed_time(e0, e1) * 1e3
            p[2] += nbytes
        return per


def _rows(per: dict[str, list], reps: int) -> dict[str, dict]:
    out = {}
    for label, (n, us, nbytes) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        out[label] = {"launches": n // reps, "us": us / reps, "us_per_launch": us / n,
                      "mb": nbytes / reps / 1e6, "gb_per_s": nbytes / (us * 1e-6) / 1e9 if nbytes and us else None}
    return out


def profile_decode(be, rec: Recorder, B: int, ctx: int, steps: int) -> dict:
    """Each launch of `steps` eager decode steps of B rows at position ctx, and the graph's replay."""
    import cupy

    from realizar_backend.backends import GREEDY, Step, run_step
    slots, positions = list(range(B)), [ctx] * B
    run_step(be, Step(slots=slots, tokens=[1] * B, positions=positions), [GREEDY] * B)   # inputs in place, graph captured
    long = be._long(B, positions)
    io = be.ws.dec_io
    rec.keys = ctx + 1
    per: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
    with be.device, be.stream:
        for _ in range(steps):
            io[1, :B] = ctx                            # a step advances its rows' positions: back to ctx
            for label, (n, us, nbytes) in rec.timed(be.kernels, lambda: be.fwd.decode_step(B, long)).items():
                p = per[label]
                p[0], p[1], p[2] = p[0] + n, p[1] + us, p[2] + nbytes
        # the captured step, replayed: each replay continues on the previous one's tokens
        io[1, :B] = ctx
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(be.stream)
        for _ in range(REPLAYS):
            be.graphs.replay(B, long)
        e1.record(be.stream)
        e1.synchronize()
        replay_us = cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / REPLAYS
    rows = _rows(per, steps)
    return {"batch": B, "context": ctx, "steps": steps, "family": be.fwd.dispatcher.decode_step(B).family,
            "long_attention": long, "eager_us_per_step": sum(r["us"] for r in rows.values()),
            "graph_replay_us_per_step": replay_us, "graph_tok_per_s": B / (replay_us * 1e-6), "rows": rows}


def profile_prefill(be, rec: Recorder, T: int, reps: int) -> dict:
    """Each launch of a T-token prompt step (one sequence from position 0), run eagerly."""
    from realizar_backend.backends.base import PrefillItem
    ids = (np.arange(T, dtype=np.int64) * 7919 % be.config.vocab_size).astype(np.int32)
    be.prefill([PrefillItem(0, ids)])                # warm: modules, workspace, cuBLAS; inputs in place
    rows_run, n_head, _, family = be.fwd.prefill_key(T, 1, T - 1)
    rec.keys = 0

    def launch():
        be.fwd.max_pos = T - 1
        be.fwd.prefill_launches(rows_run, n_head, family)

    per: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
    with be.device, be.stream:
        for _ in range(reps):
            for label, (n, us, nbytes) in rec.timed(be.kernels, launch).items():
                p = per[label]
                p[0], p[1], p[2] = p[0] + n, p[1] + us, p[2] + nbytes
    rows = _rows(per, reps)
    total = sum(r["us"] for r in rows.values())
    return {"tokens": T, "rows_run": rows_run, "family": family, "reps": reps, "gpu_us": total,
            "tok_per_s": T / (total * 1e-6), "rows": rows}


def _print(res: dict, total_key: str) -> None:
    total = res[total_key]
    print(f"{'launcher and matrices':44s} {'n':>5s} {'us':>9s} {'us/launch':>10s} {'share':>6s} {'MB':>8s} "
          f"{'GB/s':>6s}")
    for label, r in res["rows"].items():
        gb = f"{r['gb_per_s']:.0f}" if r["gb_per_s"] else "-"
        print(f"{label[:44]:44s} {r['launches']:5d} {r['us']:9.1f} {r['us_per_launch']:10.2f} "
              f"{r['us'] / total:6.1%} {r['mb']:8.2f} {gb:>6s}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1, help="decode rows (a power of two)")
    ap.add_argument("--context", type=int, default=64, help="the decode rows' position")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=0, metavar="T", help="profile a T-token prompt step instead")
    ap.add_argument("--ncu", action="store_true", help="one eager decode step and nothing else (for ncu)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.batch & (a.batch - 1):
        ap.error(f"--batch {a.batch}: a decode bucket is a power of two")
    from realizar_backend.backends import GREEDY, Step, run_step
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings
    ctx = max(a.context + REPLAYS + 8, a.prefill + 1)
    be = CUDABackend(open_model(a.model), max_slots=max(a.batch, 1), max_context=ctx,
                     settings=Settings.from_env(self_check=False))
    try:
        for s in range(a.batch):                     # every slot: its own whole context
            n = -(-be.max_context // be.block_size)
            be.set_block_table(s, range(s * n, (s + 1) * n))
        if a.ncu:
            run_step(be, Step(slots=list(range(a.batch)), tokens=[1] * a.batch, positions=[a.context] * a.batch),
                     [GREEDY] * a.batch)
            from cupyx.profiler import profile
            with be.device, be.stream:
                be.ws.dec_io[1, :a.batch] = a.context
                be.stream.synchronize()
                with profile():
                    be.fwd.decode_step(a.batch, be._long(a.batch, [a.context]))
                    be.stream.synchronize()
            return 0
        rec = Recorder(be.stream, be.config)
        try:
            if a.prefill:
                res = profile_prefill(be, rec, a.prefill, 5)
                _print(res, "gpu_us")
                print(f"prompt step of {a.prefill} tokens ({res['family']}, {res['rows_run']} rows): "
                      f"{res['gpu_us'] / 1e3:.2f} ms GPU ({res['tok_per_s']:,.0f} tok/s)")
            else:
                res = profile_decode(be, rec, a.batch, a.context, a.steps)
                _print(res, "eager_us_per_step")
                print(f"decode step of {a.batch} rows at {a.context} ({res['family']}): eager launches "
                      f"{res['eager_us_per_step']:.0f} us; graph replay {res['graph_replay_us_per_step']:.0f} us "
                      f"({res['graph_tok_per_s']:,.0f} tok/s)")
        finally:
            rec.restore()
        res["model"] = a.model
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    finally:
        be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
