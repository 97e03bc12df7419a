"""The server's side of a load test: its gauges and counters on /metrics, before and after the run."""

from __future__ import annotations

import asyncio
import time

from ..serving.metrics import ENGINE_LABEL, WORKER_LABEL

# Server metric families reported before and after the run, and the gauges that say it is idle.
METRIC_PREFIXES = ("realizar_", "llamacpp:", "vllm:")
BUSY_GAUGES = ("realizar_requests_running", "realizar_requests_waiting", "llamacpp:requests_processing",
               "llamacpp:requests_deferred", "vllm:num_requests_running", "vllm:num_requests_waiting")
SETTLE_S = 15.0            # how long to wait after the run for those gauges to reach 0
PREFIX_HITS = "realizar_prefix_cache_hit_tokens_total"   # this package's server: prompt tokens not prefilled


def metric_key(name: str, labels: dict[str, str]) -> str:
    shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{shown}}}" if shown else name


async def scrape_metrics(root: str, headers: dict[str, str]) -> dict[str, dict[str, float]] | None:
    """Gauges and counters of the known server families on /metrics; None when there are none.
    This package's server labels each series with its engine (one per GPU) and worker: the values
    are given for the whole server (summed over them; a ratio gauge averaged) and, where there
    are several, for each one too."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(root + "/metrics", headers=headers)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    per_unit: dict[tuple[bool, str], list[float]] = {}
    units: set[tuple] = set()                # (engine, worker) pairs seen
    unit_keys: list[tuple[dict, str]] = []
    for fam in families:
        if not fam.name.startswith(METRIC_PREFIXES) or fam.type not in ("gauge", "counter", "histogram"):
            continue
        gauge = fam.type == "gauge"
        out = gauges if gauge else counters
        # a histogram's _sum and _count are counters too: their deltas give the run's server-side mean
        ends = ("_sum", "_count") if fam.type == "histogram" else ("_total",)
        for s in fam.samples:
            if not gauge and not s.name.endswith(ends):
                continue                     # _created timestamps, histogram buckets
            labels = dict(s.labels)
            unit = ((labels.pop(ENGINE_LABEL, None), labels.pop(WORKER_LABEL, None))
                    if s.name.startswith("realizar_") else (None, None))
            if unit == (None, None):
                out[metric_key(s.name, labels)] = s.value
                continue
            units.add(unit)
            out[metric_key(s.name, s.labels)] = s.value
            unit_keys.append((out, metric_key(s.name, s.labels)))
            per_unit.setdefault((gauge, metric_key(s.name, labels)), []).append(s.value)
    if len({u for u in units if u[0] is not None}) < 2:       # one engine: its values are the server's
        for out, k in unit_keys:
            del out[k]
    for (gauge, key), values in per_unit.items():
        ratio = gauge and key.split("{")[0].endswith("_ratio")
        (gauges if gauge else counters)[key] = sum(values) / len(values) if ratio else sum(values)
    if not gauges and not counters:
        return None
    return {"gauges": gauges, "counters": counters}


async def scrape_settled(root: str, headers: dict[str, str]) -> tuple[dict | None, bool]:
    """/metrics once the server's running and waiting gauges are back to 0 (or SETTLE_S passed)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = await scrape_metrics(root, headers)
        busy = [m["gauges"][g] for g in BUSY_GAUGES if m and g in m["gauges"]]
        idle = bool(busy) and not any(busy)
        if m is None or idle or not busy or time.monotonic() > deadline:
            return m, idle
        await asyncio.sleep(0.25)


def histogram_means(delta: dict[str, float]) -> dict[str, dict[str, float]]:
    """name{labels} -> {"mean", "count"} over the run, from a histogram's _sum and _count deltas:
    the server's own view (e.g. its time to first token from arrival, beside the client's)."""
    out = {}
    for key, count in delta.items():
        name, brace, labels = key.partition("{")
        if not name.endswith("_count") or count <= 0:
            continue
        base = name.removesuffix("_count")
        total = delta.get(base + "_sum" + brace + labels)
        if total is not None:
            out[base + brace + labels] = {"mean": total / count, "count": count}
    return out
