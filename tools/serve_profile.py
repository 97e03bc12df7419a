"""Host time per engine step on the serving path, without a GPU: the Engine on the CPU backend runs
N concurrent streaming completions through the same code the server runs for each request
(plans.completion_plan -> the route's SSE generator -> engine.generate -> the step thread), all
on one event loop in this process, as `realizar loadtest` drives it (token-id prompts, greedy,
ignore_eos, include_usage). What it reports, per decode step:

- engine step: wall time of Engine._step on the step thread; backend: the time inside backend
  calls (forward passes, block tables, releases); host = step - backend, the engine's own work
  (scheduling, accepting tokens, detokenizing, stop checks, handing outputs to the loop);
- the event loop's CPU time (the SSE side: waking streams, merging outputs, JSON, bytes);
- a gap: step-thread time outside _step (waiting for the condition, gauges).

On a GPU the backend's share is the device step (~8 ms for qwen15 at B=64) and everything else
is what the server adds to it. Both threads share the GIL, so the loop's CPU time is host time
the step thread can lose too.

    python tools/serve_profile.py                       # 64 clients x 2 requests, 128 + 128 tokens
    python tools/serve_profile.py --profile 25          # plus cProfile of the step thread (top 25)
    python tools/serve_profile.py --temperature 1       # the sampled path (OpenAI's default)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# the server's metrics live in prometheus_client's multiprocess mode (BentoML sets this variable
# before a worker starts); set here before prometheus_client is imported, so the engine's
# observer writes the same memory-mapped files as in the server
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="serve-profile-metrics-"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realizar_backend.engine.engine import Engine  # noqa: E402
from realizar_backend.serving import openai as oa  # noqa: E402
from realizar_backend.serving import plans  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/realizar-backend/models/SmolLM2-135M-Instruct.Q4_1.gguf"
BACKEND_CALLS = ("prefill", "decode", "decode_argmax", "decode_argmax_start", "decode_argmax_finish",
                 "decode_sample", "decode_sample_start", "decode_sample_launch", "decode_sample_finish",
                 "set_block_table", "set_block_tables", "reset_counts", "release")


class TimedBackend:
    """The engine's backend with every call timed (seconds accumulated into `spent`)."""

    def __init__(self, inner):
        self._inner = inner
        self.spent = 0.0
        self.cpu_spent = 0.0    # the calling thread's CPU time in them
        self.calls: dict[str, float] = {}
        self.batch = 0          # rows of the latest decode call
        self.prefill_tokens = 0  # prompt tokens of every prefill call so far
        for name in BACKEND_CALLS:
            setattr(self, name, self._timed(name, getattr(inner, name)))

    def _timed(self, name, fn):
        def call(*a, **k):
            if name in ("decode_argmax_start", "decode_sample", "decode_sample_start"):
                self.batch = len(a[0])
            elif name == "prefill":
                self.prefill_tokens += sum(len(it.tokens) for it in a[0])
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.cpu_spent += time.thread_time() - c0
                self.spent += dt
                self.calls[name] = self.calls.get(name, 0.0) + dt
        return call

    def __getattr__(self, name):
        return getattr(self._inner, name)


class StepRecorder:
    """Wraps Engine._step: per step its wall time, backend time, the step thread's CPU time outside
    the backend, decode batch size and whether it prefilled."""

    def __init__(self, engine: Engine, backend: TimedBackend, prof: cProfile.Profile | None):
        self.engine, self.backend, self.prof = engine, backend, prof
        self.rows: list[tuple[float, float, int, bool]] = []   # (wall, backend, batch, had prefill)
        self.prompt: list[int] = []                             # prompt tokens prefilled in each step
        self.prefill_s: list[float] = []                        # time in backend.prefill in each step
        self.calls: list[dict[str, float]] = []                 # each step's time per backend call
        self.cpu: list[float] = []                              # host CPU time of each step
        self.outside = 0.0
        self._last_end: float | None = None
        self._step = engine._step
        engine._step = self.step

    def step(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        bc0 = self.backend.cpu_spent
        if self._last_end is not None:
            self.outside += t0 - self._last_end
        b0 = self.backend.spent
        self.backend.batch = 0
        pre0 = self.backend.calls.get("prefill", 0.0)
        tok0 = self.backend.prefill_tokens
        calls0 = dict(self.backend.calls)
        if self.prof is not None:
            self.prof.enable()
        try:
            self._step()
        finally:
            if self.prof is not None:
                self.prof.disable()
            t1 = time.perf_counter()
            self.cpu.append(time.thread_time() - c0 - (self.backend.cpu_spent - bc0))
            self._last_end = t1
            self.rows.append((t1 - t0, self.backend.spent - b0, self.backend.batch,
                              self.backend.calls.get("prefill", 0.0) != pre0))
            self.prompt.append(self.backend.prefill_tokens - tok0)
            self.prefill_s.append(self.backend.calls.get("prefill", 0.0) - pre0)
            self.calls.append({k: v - calls0.get(k, 0.0) for k, v in self.backend.calls.items()
                               if v != calls0.get(k, 0.0)})


async def client(engine: Engine, settings: Settings, rng: np.random.Generator, args, counts: list[int]) -> None:
    head = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": engine.model_name}
    for _ in range(args.requests):
        prompt = rng.integers(1000, min(engine.config.vocab_size, 30000), size=args.prompt_tokens).tolist()
        body = json.dumps({"model": engine.model_name, "prompt": prompt, "max_tokens": args.max_tokens,
                           "temperature": args.temperature, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}}).encode()
        plan = plans.completion_plan(body, engine, settings)
        async for chunk in oa._stream_completion(engine, plan, head):
            counts[0] += 1
            counts[1] += len(chunk)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--backend", default="cpu", help="cpu, or cuda: the same streams beside a GPU step")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chunk", type=int, default=0, help="prefill_chunk_tokens (0: the default)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile, top N functions")
    ap.add_argument("--profile-thread", choices=("step", "loop", "both"), default="step",
                    help="which thread --profile samples; Python 3.12+ allows one cProfile at a time, so 'both' "
                         "needs 3.11")
    ap.add_argument("--json", action="store_true", help="one JSON line at the end")
    args = ap.parse_args()

    kw = dict(backend=args.backend, model=args.model, max_num_seqs=args.clients,
              context_length=args.prompt_tokens + args.max_tokens + 16,
              kv_cache_tokens=args.clients * (args.prompt_tokens + args.max_tokens + 32))
    if args.chunk:
        kw["prefill_chunk_tokens"] = args.chunk
    settings = Settings(**kw)
    from realizar_backend.serving.metrics import get_metrics
    engine = Engine.from_settings(settings, observer=get_metrics(worker="1", device=args.backend))
    backend = TimedBackend(engine.backend)
    engine.backend = backend
    if args.profile and args.profile_thread == "both" and sys.version_info >= (3, 12):
        ap.error("--profile-thread both: Python 3.12+ runs one cProfile at a time; pick step or loop")
    step_prof = cProfile.Profile() if args.profile and args.profile_thread in ("step", "both") else None
    rec = StepRecorder(engine, backend, step_prof)

    loop_prof = cProfile.Profile() if args.profile and args.profile_thread in ("loop", "both") else None
    counts = [0, 0]

    async def run() -> tuple[float, float]:
        rng = np.random.default_rng(0)
        c0 = time.thread_time()
        if loop_prof is not None:
            loop_prof.enable()
        await asyncio.gather(*(client(engine, settings, np.random.default_rng([0, i]), args, counts)
                               for i in range(args.clients)))
        if loop_prof is not None:
            loop_prof.disable()
        del rng
        return time.thread_time() - c0, 0.0

    # warm up: one short request (first-call costs: numpy, tokenizer caches)
    warm = argparse.Namespace(**{**vars(args), "requests": 1, "max_tokens": 4})
    asyncio.run(client(engine, settings, np.random.default_rng(1), warm, [0, 0]))
    rec.rows.clear()
    rec.cpu.clear()
    rec.prompt.clear()
    rec.prefill_s.clear()
    rec.calls.clear()
    backend.calls.clear()
    rec.outside, rec._last_end = 0.0, None

    t0 = time.perf_counter()
    loop_cpu, _ = asyncio.run(run())
    wall = time.perf_counter() - t0
    engine.shutdown()

    rows = rec.rows
    decode = [r for r in rows if r[2] > 0 and not r[3]]
    full = [r for r in decode if r[2] == args.clients]
    cpu_full = [c * 1e3 for r, c in zip(rows, rec.cpu) if r[2] == args.clients and not r[3]]
    host = [(w - b) * 1e3 for w, b, _, _ in decode]
    host_full = [(w - b) * 1e3 for w, b, _, _ in full]
    steps = len([r for r in rows if r[2] > 0])
    pre = [(r, n) for r, n in zip(rows, rec.prompt) if n]
    pre_wall = sum(r[0] for r, _ in pre)
    tokens = args.clients * args.requests * args.max_tokens
    out = {
        "clients": args.clients, "requests": args.clients * args.requests, "temperature": args.temperature,
        "wall_s": round(wall, 2), "tokens": tokens, "tok_s": round(tokens / wall, 1), "steps": len(rows), "decode_steps": steps,
        "decode_only_steps": len(decode), "full_batch_steps": len(full),
        "host_ms_per_decode_step": {"mean": round(statistics.fmean(host), 3) if host else None,
                                    "p50": round(pct(host, 50), 3), "p90": round(pct(host, 90), 3)},
        "host_ms_full_batch": {"mean": round(statistics.fmean(host_full), 3) if host_full else None,
                               "p50": round(pct(host_full, 50), 3)},
        "host_cpu_ms_full_batch": {"mean": round(statistics.fmean(cpu_full), 3) if cpu_full else None,
                                   "p50": round(pct(cpu_full, 50), 3)},
        "host_us_per_token_full_batch": round(statistics.fmean(host_full) * 1e3 / args.clients, 1) if host_full else None,
        "backend_ms_per_decode_step": round(statistics.fmean([b * 1e3 for _, b, _, _ in decode]), 2) if decode else None,
        "loop_cpu_ms_per_decode_step": round(loop_cpu * 1e3 / max(steps, 1), 3),
        "step_thread_outside_step_ms_per_step": round(rec.outside * 1e3 / max(len(rows), 1), 3),
        "prefill_steps": len(pre), "prefill_tokens": sum(n for _, n in pre),
        "prefill_step_wall_s": round(pre_wall, 3),
        "prefill_step_tokens": {"min": min((n for _, n in pre), default=0), "max": max((n for _, n in pre), default=0)},
        "prefill_tok_s_in_steps": round(sum(n for _, n in pre) / pre_wall, 1) if pre_wall else None,
        "wall_outside_steps_s": round(wall - sum(r[0] for r in rows), 3),
        "sse_chunks": counts[0], "sse_bytes": counts[1],
        "backend_calls_s": {k: round(v, 3) for k, v in sorted(backend.calls.items())},
    }
    print(f"{out['requests']} requests ({args.clients} clients), {args.prompt_tokens}+{args.max_tokens} tokens, "
          f"temperature {args.temperature}: {wall:.1f} s ({tokens / wall:.0f} tok/s), {len(rows)} steps ({steps} decoding, "
          f"{len(decode)} decode-only, {len(full)} of the full batch)")
    print(f"  engine host time per decode-only step: mean {out['host_ms_per_decode_step']['mean']} ms, "
          f"p50 {out['host_ms_per_decode_step']['p50']}, p90 {out['host_ms_per_decode_step']['p90']}")
    print(f"  full batch ({args.clients} rows), wall: mean {out['host_ms_full_batch']['mean']} ms "
          f"({out['host_us_per_token_full_batch']} us per token)")
    print(f"  step thread CPU outside the backend, full batch: mean {out['host_cpu_ms_full_batch']['mean']} ms, "
          f"p50 {out['host_cpu_ms_full_batch']['p50']} ms")
    print(f"  backend per decode-only step: {out['backend_ms_per_decode_step']} ms")
    print(f"  event loop CPU per decode step: {out['loop_cpu_ms_per_decode_step']} ms "
          f"({counts[0]} SSE chunks)")
    print(f"  step thread outside _step: {out['step_thread_outside_step_ms_per_step']} ms per step")
    print(f"  steps with a prefill: {len(pre)}, {out['prefill_tokens']} prompt tokens "
          f"({out['prefill_step_tokens']['min']}-{out['prefill_step_tokens']['max']} a step) in "
          f"{pre_wall:.3f} s of step wall time ({out['prefill_tok_s_in_steps']} tok/s, decode rows included); "
          f"wall outside any step {out['wall_outside_steps_s']} s")
    if pre:
        print("  prefill steps (prompt tokens / decode rows / step ms / all backend calls ms / backend.prefill ms): "
              + ", ".join(f"{n}/{r[2]}/{r[0] * 1e3:.1f}/{r[1] * 1e3:.1f}/{p * 1e3:.1f}" for (r, n), p in
            zip(pre, [p for p, n in zip(rec.prefill_s, rec.prompt) if n])))
        per_call: dict[str, float] = {}
        for c, n in zip(rec.calls, rec.prompt):
            if n:
                for k, v in c.items():
                    per_call[k] = per_call.get(k, 0.0) + v
        print("  backend calls in the prefill steps, ms: " + ", ".join(
            f"{k} {v * 1e3:.1f}" for k, v in sorted(per_call.items(), key=lambda kv: -kv[1])))
    if args.profile:
        for name, prof in (("step thread (backend calls included)", step_prof), ("event loop", loop_prof)):
            if prof is None:
                continue
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            print(f"\n=== cProfile: {name}, by own time ===")
            print("\n".join(s.getvalue().splitlines()[4:]))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
