"""Per-kernel table from an `ncu --csv --print-units base` run (tools/device_check.sh): launches,
total and mean time, DRAM bytes and achieved GB/s per kernel name, largest total first."""

import csv
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows = list(csv.DictReader(line for line in open(path) if line.startswith('"')))
    per = defaultdict(lambda: {"n": 0, "ns": 0.0, "bytes": 0.0})
    seen = set()
    for r in rows:
        key = (r["ID"], r["Kernel Name"])
        # one line per kernel and grid: mmv_q8 splits into QKV / output / down / LM head
        p = per[r["Kernel Name"].split("(")[0] + " " + r.get("Grid Size", "").replace(" ", "")]
        if key not in seen:
            seen.add(key)
            p["n"] += 1
        v = float(r["Metric Value"].replace(",", ""))
        if r["Metric Name"] == "gpu__time_duration.sum":
            p["ns"] += v
        else:
            p["bytes"] += v
    total = sum(p["ns"] for p in per.values())
    print(f"{'kernel [grid]':34s} {'n':>4s} {'us total':>9s} {'us mean':>8s} {'MB':>8s} {'GB/s':>7s}")
    for name, p in sorted(per.items(), key=lambda kv: -kv[1]["ns"]):
        gbs = p["bytes"] / p["ns"] if p["ns"] else 0.0
        print(f"{name[:34]:34s} {p['n']:4d} {p['ns'] / 1e3:9.1f} {p['ns'] / 1e3 / max(p['n'], 1):8.2f} "
              f"{p['bytes'] / 1e6:8.2f} {gbs:7.0f}")
    print(f"sum of kernel times: {total / 1e3:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
