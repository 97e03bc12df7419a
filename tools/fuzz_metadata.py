"""Fuzz the loader's metadata checks with mutants of a real GGUF header (see tests/support/metadata_fuzz.py).

    python tools/fuzz_metadata.py --count 5000 --seed 1        # the default SmolLM2
    python tools/fuzz_metadata.py --model x.gguf --count 200 --json out.json

Prints the counts of outcomes (ok, typed, and any findings: untyped, hang, crash) every few
hundred mutants and at the end; exits 1 when there is a finding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]      # this checkout's package, and the fuzzer

from support.metadata_fuzz import ACCEPTABLE, fuzz, summary  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--start", type=int, default=0, help="first mutant index (to resume or replay one)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one mutant may take")
    ap.add_argument("--json", help="write every result to this file")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from realizar_backend.model.default import default_model_path
        model = default_model_path()
    results = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-metadata-") as tmp:
        for r in fuzz(model, args.seed, args.count, Path(tmp), args.timeout, args.start):
            results.append(r)
            if r.outcome not in ACCEPTABLE:
                print(f"FINDING #{r.index} ({r.mutation}): {r.outcome}: {r.detail}", flush=True)
            if len(results) % 250 == 0:
                counts = Counter(x.outcome for x in results)
                print(f"{len(results)}/{args.count} after {time.monotonic() - t0:.0f} s: {dict(counts)}", flush=True)
    print(summary(results, time.monotonic() - t0))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0 if all(r.outcome in ACCEPTABLE for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
