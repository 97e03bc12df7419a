"""Speed through the service: streaming decode tok/s and time to first token, seen by a client
(the official `openai` client) and at the server (the realizar_* histograms on /metrics).

    python tools/serve_bench.py --url http://127.0.0.1:3000 --prompt-tokens 128 --gen-tokens 128

Random token ids as the prompt (the completions API takes a list of ids), so a shape twin
measures the same as the real model. Prints a table and one JSON line; --json writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

import numpy as np
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name == name + "_sum":
                    total += s.value
                elif s.name == name + "_count":
                    count += s.value
    return total, count


def one_stream(client: OpenAI, model: str, prompt: list[int], gen: int) -> dict[str, float]:
    t0 = time.perf_counter()
    first = None
    n = 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=gen, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            n += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    usage_tokens = gen
    return {"ttft_s": first - t0, "decode_tok_s": (usage_tokens - 1) / (end - first), "e2e_s": end - t0,
            "chunks": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:3000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    vocab_hint = 1000   # ids below this exist in every supported vocabulary
    rng = np.random.default_rng(0)
    # warm-up at the measured prompt length: first-use costs (workspace growth, cuBLAS set-up) are
    # paid once per server, like `realizar bench`'s warm-up
    one_stream(client, model, rng.integers(0, vocab_hint, args.prompt_tokens).tolist(), 8)
    ttft_sum0, ttft_n0 = histogram_totals(args.url, "realizar_time_to_first_token_seconds")
    runs = [one_stream(client, model, rng.integers(0, vocab_hint, args.prompt_tokens).tolist(), args.gen_tokens)
            for _ in range(args.repetitions)]
    ttft_sum1, ttft_n1 = histogram_totals(args.url, "realizar_time_to_first_token_seconds")
    result = {
        "model": model, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "client_decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "client_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in runs),
        "server_ttft_ms_mean": 1000 * (ttft_sum1 - ttft_sum0) / max(ttft_n1 - ttft_n0, 1),
        "runs": runs,
    }
    print("| model | prompt | gen | client tok/s | client TTFT ms | server TTFT ms |")
    print("|---|---|---|---|---|---|")
    print(f"| {model} | {args.prompt_tokens} | {args.gen_tokens} | {result['client_decode_tok_s']:.1f} | "
          f"{result['client_ttft_ms']:.1f} | {result['server_ttft_ms_mean']:.1f} |")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
