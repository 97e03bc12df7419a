"""Where a short prompt's time to first token goes, on the GPU: the engine's time to its first
output for a 128-token prompt, backend.prefill alone (host wall time), and the GPU time of the same
prefill (CUDA events on the backend's stream), per prefill precision. Host wall well above GPU time
means the prefill is bound by Python launch overhead, not by the kernels.

    python tools/ttft_probe.py MODEL.gguf [--tokens 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import cupy

    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.engine.engine import Engine
    from realizar_backend.engine.sampling import SamplingParams
    from realizar_backend.settings import Settings

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--precisions", default="split16,fp16")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {}
    for prec in a.precisions.split(","):
        eng = Engine.from_settings(Settings(model=a.model, backend="cuda", max_num_seqs=4, context_length=1024,
                                            prefill_precision=prec))
        rng = np.random.default_rng(0)
        ttft = []
        for _ in range(6):
            ids = rng.integers(0, 1000, a.tokens).tolist()
            t = time.perf_counter()
            g = eng.generate_sync(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            next(g)
            ttft.append(1e3 * (time.perf_counter() - t))
            list(g)
        be = eng.backend
        wall, gpu = [], []
        for _ in range(6):
            ids = np.asarray(rng.integers(0, 1000, a.tokens), np.int32)
            # the engine is idle: slot 3 and free blocks are the probe's for a moment
            eng.kv.allocate("probe", lambda i, j: ids[i:j], len(ids))
            be.set_block_table(3, eng.kv.table("probe"))
            t = time.perf_counter()
            be.prefill([PrefillItem(3, ids, 0)])
            wall.append(1e3 * (time.perf_counter() - t))
            # GPU time alone: the launches queue behind a 100 ms busy-wait, then run back to back
            # (prefill ends in a device-to-host copy, which waits for them)
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            with be.device, be.stream:
                be.kernels.spin_ns((1,), (1,), (np.int64(100_000_000),))
                e0.record(be.stream)
            be.prefill([PrefillItem(3, ids, 0)])
            e1.record(be.stream)
            e1.synchronize()
            gpu.append(cupy.cuda.get_elapsed_time(e0, e1))
            be.release(3)
            eng.kv.free("probe")
        r = {"engine_ttft_ms": float(np.median(ttft[1:])), "prefill_wall_ms": float(np.median(wall[1:])),
             "prefill_gpu_ms": float(np.median(gpu[1:]))}
        out[prec] = r
        print(f"[{prec}] {a.tokens}-token prompt: engine TTFT {r['engine_ttft_ms']:.1f} ms, backend.prefill "
              f"{r['prefill_wall_ms']:.1f} ms wall / {r['prefill_gpu_ms']:.1f} ms GPU")
        eng.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
