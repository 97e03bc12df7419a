"""The load test's report: counts, rates, latency percentiles and the server's metrics, as a dict
(--json), a table, and one line per request (--requests-out)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from .config import RequestResult
from .server_metrics import BUSY_GAUGES, PREFIX_HITS, SETTLE_S, histogram_means


def summary(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    a = np.asarray(xs, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()),
            "min": float(a.min()), "max": float(a.max()), "count": int(a.size)}


def build_report(cfg, model, results, elapsed, before, after, settled, chat_words, chat_tokens) -> dict[str, Any]:
    by = {s: [r for r in results if r.status == s] for s in ("ok", "cancelled", "cut", "error")}
    errors: dict[str, dict[str, Any]] = {}
    for r in by["error"]:
        e = errors.setdefault(r.error[0], {"count": 0, "message": r.error[1]})
        e["count"] += 1
    ok = by["ok"]
    # a finished stream carries the server's usage where supported; a cancelled or cut one only chunks
    counted = {"usage" if r.usage_tokens is not None else "chunks" for r in results if r.tokens}
    output_tokens = sum(r.tokens for r in results)
    prompt = [r.prompt_tokens for r in results if r.prompt_tokens is not None]
    server = None
    if before is not None:
        after = after or {"gauges": {}, "counters": {}}
        delta = {k: v - before["counters"].get(k, 0.0) for k, v in after["counters"].items()}
        server = {"gauges_before": before["gauges"], "gauges_after": after["gauges"], "settled": settled,
                  "counters_delta": {k: v for k, v in delta.items() if not k.split("{")[0].endswith(("_sum", "_count"))},
                  "histogram_means": histogram_means(delta),
                  # prompt tokens this run did not prefill (our server's counter; None elsewhere)
                  "prefix_cache_hit_tokens": sum(v for k, v in delta.items() if k.split("{")[0] == PREFIX_HITS)
                  if any(k.split("{")[0] == PREFIX_HITS for k in delta) else None}
    return {
        "url": cfg.root, "model": model, "mode": cfg.mode,
        "config": {"clients": cfg.clients, "requests": cfg.requests, "duration_s": cfg.duration_s,
                   "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens,
                   "random_cancel": cfg.random_cancel, "seed": cfg.seed, "ignore_eos": cfg.ignore_eos,
                   "processes": cfg.process_count},
        "chat_prompt_words": chat_words or None, "chat_prompt_tokens_sized": chat_tokens,
        "requests": {"sent": len(results), "completed": len(ok), "cancelled": len(by["cancelled"]),
                     "cut": len(by["cut"]), "errors": len(by["error"]),
                     "not_started": cfg.requests - len(results)},
        "errors": errors,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "tokens_counted_by": " and ".join(sorted(counted, reverse=True)) or None,
        "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None,
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "ttft_s": summary([r.ttft for r in results if r.ttft is not None]),
        "itl_s": summary([g for r in results for g in r.gaps]),
        "tpot_s": summary([(r.end - r.start - r.ttft) / (r.tokens - 1) for r in ok
                            if r.ttft is not None and r.tokens > 1]),
        "e2e_s": summary([r.end - r.start for r in ok]),
        "server": server,
    }


def format_report(rep: dict[str, Any]) -> str:
    q = rep["requests"]
    lines = ["| loadtest | |", "|---|---|",
             f"| server | {rep['url']} |", f"| model | {rep['model']} ({rep['mode']}) |",
             f"| clients | {rep['config']['clients']} |",
             f"| requests | {q['sent']} sent: {q['completed']} completed, {q['cancelled']} cancelled, "
             f"{q['cut']} cut at the time limit, {q['errors']} errors ({q['not_started']} not started) |",
             f"| elapsed | {rep['elapsed_s']:.2f} s |",
             f"| output tokens | {rep['output_tokens']:,} (counted by {rep['tokens_counted_by'] or '-'}) |",
             f"| generation tok/s | {rep['output_tokens_per_s']:,.1f} |",
             f"| requests/s | {rep['requests_per_s']:.2f} |"]
    if rep["prompt_tokens_mean"] is not None:
        lines.append(f"| prompt tokens (mean, server's count) | {rep['prompt_tokens_mean']:.1f} |")
    lines += ["", "| latency (ms) | p50 | p90 | p99 | mean | max | n |", "|---|---|---|---|---|---|---|"]
    for name, key in (("time to first token", "ttft_s"), ("inter-token (per chunk)", "itl_s"),
                      ("time per output token", "tpot_s"), ("end to end", "e2e_s")):
        s = rep[key]
        if s:
            lines.append(f"| {name} | " + " | ".join(f"{1000 * s[k]:.1f}" for k in ("p50", "p90", "p99", "mean", "max"))
                         + f" | {s['count']} |")
        else:
            lines.append(f"| {name} | - | - | - | - | - | 0 |")
    if rep["errors"]:
        lines += ["", "| error | count | first message |", "|---|---|---|"]
        for key, e in sorted(rep["errors"].items(), key=lambda kv: -kv[1]["count"]):
            msg = " ".join(e["message"].split())[:120].replace("|", "/")
            lines.append(f"| {key} | {e['count']} | {msg} |")
    srv = rep["server"]
    if srv:
        lines += ["", "| server metric | before | after |", "|---|---|---|"]
        for k in sorted(set(srv["gauges_before"]) | set(srv["gauges_after"])):
            b, a = srv["gauges_before"].get(k), srv["gauges_after"].get(k)
            if b or a or k in BUSY_GAUGES or "kv_cache" in k:
                lines.append(f"| {k} | {_num(b)} | {_num(a)} |")
        for k, d in sorted(srv["counters_delta"].items()):
            if d:
                lines.append(f"| {k} | | +{_num(d)} |")
        if srv.get("histogram_means"):
            lines += ["", "| server histogram (this run) | mean | count |", "|---|---|---|"]
            for k, h in sorted(srv["histogram_means"].items()):
                unit = 1000.0 if "_seconds" in k else 1.0
                lines.append(f"| {k}{' (ms)' if unit != 1.0 else ''} | {_num(h['mean'] * unit)} | {_num(h['count'])} |")
        if not srv["settled"]:
            lines.append(f"| (server still busy {SETTLE_S:g} s after the run) | | |")
    return "\n".join(lines)


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.4g}"


def write_requests(results: list[RequestResult], path: str) -> None:
    """One JSON line per request, its times as Unix epoch seconds (to line up with a server's own
    logs or step trace): start, first token, end of stream read, closed; status and tokens."""
    epoch = time.time() - time.perf_counter()
    at = lambda t: None if t is None else round(epoch + t, 6)      # noqa: E731
    with open(path, "w") as f:
        for r in sorted(results, key=lambda r: r.index):
            f.write(json.dumps({"index": r.index, "status": r.status, "start": at(r.start),
                                "first_token": at(None if r.ttft is None else r.start + r.ttft),
                                "done": at(r.done), "end": at(r.end), "tokens": r.tokens,
                                "error": r.error[0] if r.error else None}) + "\n")
