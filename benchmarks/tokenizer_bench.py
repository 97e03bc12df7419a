"""What a model's header and tokenizer cost a start, and how much of it holds the GIL (the tokenizer
builds on a thread while the device starts; what it holds, the device's start waits for).

    python benchmarks/tokenizer_bench.py MODEL.gguf [MODEL.gguf ...] [--repeats 5] [--json out.json]

Per model, in this process: open_model (the header), Tokenizer.from_model_file (its chat template
check included; the render workers already started after the first), wall and the building
thread's CPU time; then the same build on a thread beside a pure-Python loop on this one, and how
much longer the loop took than alone (the GIL the build held). Minimum and median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realizar_backend.formats import open_model  # noqa: E402
from realizar_backend.model.chat_template import TemplateLimits  # noqa: E402
from realizar_backend.model.tokenizer import Tokenizer  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402

_SPIN = 25_000_000        # ~1 s of pure Python here: longer than any build, so it covers it


def _spin() -> float:
    t = time.perf_counter()
    x = 0
    for i in range(_SPIN):
        x += i
    return time.perf_counter() - t


def measure(path: str, repeats: int) -> dict:
    limits = TemplateLimits.from_settings(Settings())
    opened, walls, cpus, held = [], [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        mf = open_model(path)
        opened.append(time.perf_counter() - t)
        t, c = time.perf_counter(), time.thread_time()
        tok = Tokenizer.from_model_file(mf, limits)
        walls.append(time.perf_counter() - t)
        cpus.append(time.thread_time() - c)
    alone = min(_spin() for _ in range(2))
    for _ in range(repeats):
        build = threading.Thread(target=Tokenizer.from_model_file, args=(mf, limits))
        build.start()
        held.append(_spin() - alone)
        build.join()

    def stat(v):
        return {"min_ms": round(min(v) * 1e3, 1), "median_ms": round(statistics.median(v) * 1e3, 1)}

    return {"model": Path(path).name, "vocab": tok.vocab_size, "open_model": stat(opened),
            "tokenizer_wall": stat(walls), "tokenizer_cpu": stat(cpus), "gil_held": stat(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [measure(m, args.repeats) for m in args.models]
    cols = ("open_model", "tokenizer_wall", "tokenizer_cpu", "gil_held")
    print("| model | vocab | " + " | ".join(f"{c} ms (min / median)" for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = " | ".join(f"{r[c]['min_ms']:.0f} / {r[c]['median_ms']:.0f}" for c in cols)
        print(f"| {r['model']} | {r['vocab']:,} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
