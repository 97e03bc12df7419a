"""Where a decode step's attention spends its time, block by block: the flash-decoding kernel built
with -DFLD_TIMING (kernels/flash_timing.cuh: thread 0 of each block stamps %globaltimer at each
step, a clock shared by the whole GPU), one captured decode step replayed, and per step of the
kernel the earliest, median and latest block, in us after the launch's first block got past
pdl_wait (the kernel before it done). The stamps cost the step a few percent; compare timelines
with each other, and time steps with tools/step_knockouts.py or `realizar bench`.

    python tools/decode_timeline.py --model /tmp/twins/qwen15.gguf --depth 4096
    python tools/decode_timeline.py --model /tmp/twins/qwen15.gguf --depth 16384 --npy tl.npy

Rows of the table are the points of flash_timing.cuh; a launch of the one-row plan is 28 (layers)
groups of blocks, the first and last two left out of the medians. --npy keeps the raw records.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POINTS = ["entry", "past pdl_wait", "q ready", "every key read", "warps merged", "copies pushed",
          "own slices combined", "exit", "won the vote", "partials' (M, L) in", "output stored",
          "first tile landed", "its scores", "its P.V"]


def timing_kernels(modules: dict):
    """Patch FlashKernels so that decode plans compile with -DFLD_TIMING (NVRTC), keeping each
    module in `modules` for its globals."""
    import cupy

    from realizar_backend.backends.cuda import flash
    from realizar_backend.kernels import catalog

    def _future(self, plan):
        fname = "flash_prefill.cu" if plan.kernel.startswith("flash_prefill") else "flash_decode.cu"
        extra = ("-DFLD_TIMING=1",) if fname == "flash_decode.cu" else ()
        key = (fname, plan.options + extra, plan.kernel)
        fut = self._mods.get(key)
        if fut is None:
            with self.device:
                opts = catalog.base_options(self.device.compute_capability) + plan.options + extra
                mod = cupy.RawModule(code=catalog.source(fname), options=opts)
                fn = mod.get_function(plan.kernel)
                _ = fn.attributes
            if extra:
                modules["decode"] = mod
            fut = self._mods[key] = Future()
            fut.set_result(fn)
        return fut

    flash.FlashKernels._future = _future


def summarize(rec: np.ndarray) -> dict:
    """Per point: (min, median, max) over blocks of each launch, us after the launch's first
    pdl_wait, medians over the launches; plus the gap to the next launch."""
    rec = rec[np.argsort(rec[:, 1])]
    launches = np.split(rec, np.where(np.diff(rec[:, 1]) > 5000)[0] + 1)   # launches are > 5 us apart
    inner = launches[2:-2] if len(launches) > 6 else launches
    out = {}
    for k, name in enumerate(POINTS):
        rows = []
        for blk in inner:
            base = blk[:, 1].min()
            col = blk[:, k][blk[:, k] > 0]
            if len(col):
                rows.append(((col.min() - base) / 1e3, (np.median(col) - base) / 1e3, (col.max() - base) / 1e3))
        if rows:
            out[name] = [float(x) for x in np.median(np.array(rows), axis=0)]
    gaps = [(b[:, 1].min() - a[:, 7].max()) / 1e3 for a, b in zip(launches, launches[1:])]
    periods = [(b[:, 1].min() - a[:, 1].min()) / 1e3 for a, b in zip(launches, launches[1:])]
    out["_launches"] = len(launches)
    out["_blocks"] = int(np.median([len(b) for b in launches]))
    out["_after_exit_to_next_release"] = float(np.median(gaps)) if gaps else None
    out["_layer_period"] = float(np.median(periods)) if periods else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file (a shape twin will do)")
    ap.add_argument("--depth", type=int, default=4096, help="keys the row attends to (a prompt of that many first)")
    ap.add_argument("--batch", type=int, default=1, help="rows of the step (a batch bucket)")
    ap.add_argument("--npy", default=None, help="write the raw records here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    modules: dict = {}
    timing_kernels(modules)
    import cupy

    sys.path.insert(0, str(ROOT / "tests"))
    from paging import contiguous_tables

    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings
    model = open_model(args.model)
    B, P = args.batch, args.depth
    gpu = contiguous_tables(CUDABackend(model, max_slots=max(B, 4), max_context=P + 64,
                                        settings=Settings(self_check=False)))
    try:
        rng = np.random.default_rng(0)
        for s in range(B):
            gpu.prefill([PrefillItem(s, rng.integers(0, model.config.vocab_size, P).astype(np.int32))])
        rows = (list(range(B)), [1] * B, [P] * B)
        long = gpu._long(B, rows[2])
        if not long:
            raise SystemExit(f"depth {P}: the step takes the short-row attention, not flash-decoding")
        gpu.decode(*rows)                      # eager, then captured
        gpu.decode(*rows)
        if "decode" not in modules:
            raise SystemExit("the decode step launched no flash-decoding kernel")
        mod = modules["decode"]
        count = cupy.ndarray((1,), cupy.uint32, mod.get_global("fld_tn"))
        cap, width = 65536, len(POINTS) + 3
        table = cupy.ndarray((cap, width), cupy.uint64, mod.get_global("fld_tl"))
        with gpu.device, gpu.stream:
            for _ in range(3):
                gpu.graphs.replay(B, long)
            gpu.stream.synchronize()
            count.fill(0)
            gpu.graphs.replay(B, long)
            gpu.stream.synchronize()
        n = int(count.get()[0])
        rec = table[:min(n, cap)].get().astype(np.int64)
    finally:
        gpu.close()
    if args.npy:
        np.save(args.npy, rec)
    if n == 0:
        raise SystemExit("no records: the step's rows took no cluster path")
    s = summarize(rec)
    print(f"depth {P}, batch {B}: {s['_launches']} launches of ~{s['_blocks']} blocks; us after the launch's "
          "first pdl release")
    print(f"{'point':<22} {'first':>7} {'median':>7} {'last':>7}")
    for name in POINTS:
        if name in s:
            a, b, c = s[name]
            print(f"{name:<22} {a:7.2f} {b:7.2f} {c:7.2f}")
    print(f"from the last exit to the next launch's pdl release: {s['_after_exit_to_next_release']:.2f} us; "
          f"layer period {s['_layer_period']:.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(depth=P, batch=B, **s), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
