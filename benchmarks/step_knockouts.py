"""Where a decode step's time goes, by knockouts: the step of B rows is captured as a CUDA graph
with one operation of the model left out of every layer (forward.StepOps: q/k/v, attention, the
output projection, gate/up, down; or the LM head, the tensor-core steps' prep launches, or every
layer), replayed, and timed against the whole step. The difference is that operation's cost on the
step's critical path, launch gaps and programmatic-launch overlap included, which a per-kernel
profile (benchmarks/decode_profile.py: serialized launches) does not show. The numbers a
knocked-out step computes are garbage; only its time counts.

    python benchmarks/step_knockouts.py --model /tmp/twins/qwen15.gguf --batches 1,4 --json ko.json
    python benchmarks/step_knockouts.py --model /tmp/twins/qwen15.gguf --batches 1 --position 4096   (at depth)

Prints one line per (batch, knockout): us per step (median of --reps timings of --replays
replays each) and the difference from the whole step; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _noop(*_a, **_k) -> None:
    return None


def knockouts(fwd, family: str) -> dict[str, list[tuple[object, str, object]]]:
    """(object, attribute, stand-in) triples per knockout name: an operation of the model
    (forward.StepOps) that returns its usual workspace buffer without launching anything."""
    from realizar_backend.backends.cuda import forward, linear, mmq
    S, ws = forward.StepOps, fwd.ws
    residual = S.linear_residual

    def skip(role: str):
        def linear_residual(self, a, w, *rest, **kw):
            return self.fwd.ws.x if role in w.name else residual(self, a, w, *rest, **kw)
        return linear_residual

    def gated(self, *_a, **_k):
        # a split16 step's down projection reads the gated MLP's output as split rows
        return linear.SplitRows(ws.split_inv[1].data.ptr) if self.step.family == "split16" else ws.a

    out: dict[str, list[tuple[object, str, object]]] = {
        "whole step": [],
        "no q/k/v": [(S, "norm_linear", lambda self, x, norm, mats, *_a, **_k: (ws.q, ws.k, ws.v)[:len(mats)])],
        "no attention": [(S, "attention", lambda self, *_a, **_k: ws.attn)],
        "no o": [(S, "linear_residual", skip("attn_output"))],
        "no gate/up": [(S, "norm_gated_mlp", gated)],
        "no down": [(S, "linear_residual", skip("ffn_down"))],
        "no head": [(S, "logits", lambda self, *_a, **_k: ws.logits)],
    }
    if family == "mmq":
        # the launches then read stale records: the prep buffer's check is knocked out with them
        out["no prep"] = [(linear.MmqLinear, "_prep", _noop), (mmq, "_check", _noop)]
    out["no layers"] = [(fwd.model, "layers", [])]
    return out


def time_step(gpu, B: int, reps: int, replays: int, position: int = 128) -> float:
    """us per replay of bucket B's captured step (captured afresh, at `position`)."""
    import cupy
    gpu.graphs.graphs.clear()
    gpu.graphs.status.clear()
    args = (list(range(B)), [1] * B, [position] * B)
    gpu.decode(*args)                   # eager, then captured
    long = gpu._long(B, args[2])        # the bucket's graph for rows this deep (flash-decoding)
    ts = []
    for _ in range(reps):
        gpu.decode(*args)               # back to `position` (replays advance the positions)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        with gpu.stream:
            e0.record(gpu.stream)
            for _ in range(replays):
                gpu.graphs.replay(B, long)
            e1.record(gpu.stream)
        e1.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(e0, e1) / replays * 1000)
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file (a shape twin will do)")
    ap.add_argument("--batches", default="1,4", help="decode batch buckets, comma-separated (powers of two)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--position", type=int, default=128,
                    help="the rows' position (context depth) the step decodes at; prompts of that many tokens first")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from support.paging import contiguous_tables

    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings
    model = open_model(args.model)
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for B in (int(x) for x in args.batches.split(",") if x):
        if B & (B - 1):
            raise SystemExit(f"--batches: {B} is not a batch bucket (a power of two)")
        context = args.position + 2 * args.replays + 64
        gpu = contiguous_tables(CUDABackend(model, max_slots=max(B, 4), max_context=context,
                                            settings=Settings(self_check=False)))
        try:
            gpu.prefill([PrefillItem(s, rng.integers(0, V, args.position).astype(np.int32)) for s in range(B)])
            family = gpu.fwd.dispatcher.decode_step(B).family
            whole = None
            for name, patches in knockouts(gpu.fwd, family).items():
                saved = [(o, a, a in vars(o), getattr(o, a)) for o, a, _ in patches]
                try:
                    for o, a, stand_in in patches:
                        setattr(o, a, stand_in)
                    us = time_step(gpu, B, args.reps, args.replays, args.position)
                finally:
                    for o, a, own, f in reversed(saved):
                        if own:
                            setattr(o, a, f)
                        else:
                            delattr(o, a)        # an instance's stand-in: its class's method again
                whole = us if whole is None else whole
                row = dict(batch=B, position=args.position, family=family, knockout=name, us=us, cost_us=whole - us)
                rows.append(row)
                print(f"B={B:<4} {family:<8} {name:<14} {us:9.1f} us/step  cost {whole - us:8.1f} us", flush=True)
        finally:
            gpu.close()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
