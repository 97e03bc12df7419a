"""`realizar loadtest` against a real `bentoml serve` CPU server: the report's counts agree with
the server's own metrics, chat prompts are sized to the asked length, random cancels and the time
limit close streams and the server frees them, and a bad URL or model is reported by error type."""

from __future__ import annotations

import json
import os

import pytest

from support.server import API_KEY, free_port, sample, wait_for

from realizar_backend.cli import main

pytestmark = [pytest.mark.server, pytest.mark.slow]


def loadtest(url: str, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    rc = main(["loadtest", url, "--json", str(out), *args])
    return rc, json.loads(out.read_text())


def idle(server) -> bool:
    m = server.metrics()
    return sample(m, "realizar_requests_running") == 0 and sample(m, "realizar_requests_waiting") == 0


def delta(after, before, name, **labels) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def assert_ordered(summary: dict, count: int | None = None) -> None:
    assert 0 < summary["min"] <= summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]
    assert summary["min"] <= summary["mean"] <= summary["max"]
    if count is not None:
        assert summary["count"] == count


def test_report_agrees_with_the_server(server, tmp_path, capsys):
    assert wait_for(lambda: idle(server), 30)
    before = server.metrics()
    rc, rep = loadtest(server.url, tmp_path, "--api-key", API_KEY, "--clients", "3", "--requests", "7",
                       "--prompt-tokens", "16", "--max-tokens", "4", "--requests-out", str(tmp_path / "req.jsonl"))
    after = server.metrics()
    assert rc == 0
    # --requests-out: each request's times, in order, on the wall clock
    reqs = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
    assert [r["index"] for r in reqs] == list(range(7))
    assert all(r["status"] == "ok" and r["tokens"] == 4 and r["error"] is None for r in reqs)
    assert all(r["start"] < r["first_token"] <= r["done"] <= r["end"] for r in reqs)
    assert max(r["end"] for r in reqs) - min(r["start"] for r in reqs) <= rep["elapsed_s"] + 0.05
    assert rep["model"] == "SmolLM2-135M-Instruct" and rep["mode"] == "completions"
    assert rep["requests"] == {"sent": 7, "completed": 7, "cancelled": 0, "cut": 0, "errors": 0, "not_started": 0}
    assert rep["errors"] == {}
    # ignore_eos: every request generates exactly max_tokens, counted from the usage chunks
    assert rep["output_tokens"] == 7 * 4 and rep["tokens_counted_by"] == "usage"
    assert rep["prompt_tokens_mean"] == 16
    assert delta(after, before, "realizar_generation_tokens_total") == rep["output_tokens"]
    assert delta(after, before, "realizar_prompt_tokens_total") == 7 * 16
    assert delta(after, before, "realizar_requests_total", finish_reason="length") == 7
    srv = rep["server"]
    assert srv["settled"]
    assert srv["counters_delta"]["realizar_generation_tokens_total"] == rep["output_tokens"]
    assert srv["counters_delta"]['realizar_requests_total{finish_reason="length"}'] == 7
    assert srv["gauges_after"]["realizar_requests_running"] == 0
    assert "realizar_kv_cache_usage_ratio" in srv["gauges_before"]
    # the server's histograms over the run: its own first-token time (from arrival) is within the client's
    means = srv["histogram_means"]
    assert means["realizar_time_to_first_token_seconds"]["count"] == 7
    assert 0 < means["realizar_time_to_first_token_seconds"]["mean"] <= rep["ttft_s"]["mean"]
    assert means["realizar_prompt_length_tokens"] == {"mean": 16, "count": 7}
    assert not any(k.endswith(("_sum", "_count")) for k in srv["counters_delta"])

    assert_ordered(rep["ttft_s"], 7)
    assert_ordered(rep["e2e_s"], 7)
    assert_ordered(rep["tpot_s"], 7)
    assert_ordered(rep["itl_s"])
    assert rep["ttft_s"]["max"] <= rep["e2e_s"]["max"]
    assert rep["output_tokens_per_s"] == pytest.approx(rep["output_tokens"] / rep["elapsed_s"])
    assert rep["requests_per_s"] == pytest.approx(7 / rep["elapsed_s"])

    out = capsys.readouterr()
    assert "| generation tok/s |" in out.out and "| time to first token |" in out.out
    assert "| realizar_kv_cache_usage_ratio |" in out.out
    assert "| realizar_time_to_first_token_seconds (ms) |" in out.out
    assert "loadtest: 3 clients" in out.err


def test_clients_spread_over_processes(server, tmp_path, capsys):
    """--processes: the clients in several client processes, one report over all of them that
    agrees with the server, every request sent once."""
    assert wait_for(lambda: idle(server), 30)
    before = server.metrics()
    rc, rep = loadtest(server.url, tmp_path, "--api-key", API_KEY, "--clients", "3", "--requests", "7",
                       "--prompt-tokens", "16", "--max-tokens", "3", "--processes", "2",
                       "--requests-out", str(tmp_path / "req.jsonl"))
    after = server.metrics()
    assert rc == 0 and rep["config"]["processes"] == 2
    assert rep["requests"] == {"sent": 7, "completed": 7, "cancelled": 0, "cut": 0, "errors": 0, "not_started": 0}
    assert rep["output_tokens"] == 7 * 3 == delta(after, before, "realizar_generation_tokens_total")
    assert delta(after, before, "realizar_prompt_tokens_total") == 7 * 16
    reqs = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
    assert [r["index"] for r in reqs] == list(range(7))
    assert all(r["start"] < r["first_token"] <= r["done"] <= r["end"] for r in reqs)
    # both processes start at the same line: each one's first request goes out at once
    assert abs(reqs[0]["start"] - reqs[1]["start"]) < 0.5
    assert_ordered(rep["ttft_s"], 7)
    assert rep["output_tokens_per_s"] == pytest.approx(rep["output_tokens"] / rep["elapsed_s"])
    assert "3 clients in 2 processes" in capsys.readouterr().err


def test_a_repeated_seed_is_reported_as_prefix_cache_hits(server, tmp_path, capsys):
    """Prompts differ within a run; a second run with the same seed sends the same prompts, which the
    server then finds in its prefix cache: the report counts them and says so on stderr."""
    args = ["--api-key", API_KEY, "--clients", "2", "--requests", "3", "--prompt-tokens", "40", "--max-tokens", "2",
            "--seed", "424242"]
    assert wait_for(lambda: idle(server), 30)
    rc, first = loadtest(server.url, tmp_path, *args)
    assert rc == 0 and first["server"]["prefix_cache_hit_tokens"] == 0
    assert "prefix cache" not in capsys.readouterr().err
    assert wait_for(lambda: idle(server), 30)
    rc, again = loadtest(server.url, tmp_path, *args)
    # each prompt's two full blocks of 16 tokens come from the cache
    assert rc == 0 and again["server"]["prefix_cache_hit_tokens"] >= 3 * 32
    assert "in its prefix cache and did not prefill them" in capsys.readouterr().err


def test_chat_prompts_are_sized_by_the_server(server, tmp_path):
    assert wait_for(lambda: idle(server), 30)
    before = server.metrics()
    rc, rep = loadtest(server.url, tmp_path, "--api-key", API_KEY, "--mode", "chat", "--clients", "2",
                       "--requests", "4", "--prompt-tokens", "40", "--max-tokens", "3")
    after = server.metrics()
    assert rc == 0 and rep["requests"]["completed"] == 4
    # template included, as the server counts it; random words make each prompt a little different
    assert rep["chat_prompt_tokens_sized"] == pytest.approx(40, abs=2)
    assert rep["prompt_tokens_mean"] == pytest.approx(40, abs=4)
    assert rep["output_tokens"] == 4 * 3
    assert delta(after, before, "realizar_generation_tokens_total") >= rep["output_tokens"]   # + sizing requests
    assert rep["server"]["counters_delta"]["realizar_generation_tokens_total"] == rep["output_tokens"]


def test_random_cancel_frees_the_streams(server, tmp_path):
    assert wait_for(lambda: idle(server), 30)
    before = server.metrics()
    rc, rep = loadtest(server.url, tmp_path, "--api-key", API_KEY, "--clients", "4", "--requests", "8",
                       "--prompt-tokens", "16", "--max-tokens", "32", "--random-cancel", "0.5", "--seed", "0")
    assert rc == 0
    q = rep["requests"]
    assert 1 <= q["cancelled"] < 8 and q["completed"] + q["cancelled"] == 8 and q["errors"] == 0
    assert rep["tokens_counted_by"] == "usage and chunks"
    assert rep["output_tokens"] < 8 * 32
    assert rep["server"]["settled"]
    assert rep["server"]["gauges_after"]["realizar_requests_running"] == 0
    assert wait_for(lambda: idle(server), 15)
    after = server.metrics()
    assert sample(after, "realizar_kv_cache_usage_ratio") == 0
    finished = sum(delta(after, before, "realizar_requests_total", finish_reason=r) for r in ("length", "abort"))
    assert finished == 8
    # a stream closed just as its last token came may still finish on the server
    assert 1 <= delta(after, before, "realizar_requests_total", finish_reason="abort") <= q["cancelled"]


def test_time_limit_cuts_open_streams(server, tmp_path):
    assert wait_for(lambda: idle(server), 30)
    rc, rep = loadtest(server.url, tmp_path, "--api-key", API_KEY, "--clients", "2", "--requests", "50",
                       "--prompt-tokens", "16", "--max-tokens", "490", "--duration", "4")
    assert rc == 0
    assert rep["requests"] == {"sent": 2, "completed": 0, "cancelled": 0, "cut": 2, "errors": 0, "not_started": 48}
    # 4 s: on a loaded 2-core machine the first tokens took more than 3 s (the streams were cut empty);
    # 490 tokens (the server's context is 512) take the CPU backend far longer than that
    assert 4 <= rep["elapsed_s"] < 9
    assert rep["output_tokens"] > 0 and rep["e2e_s"] is None
    assert wait_for(lambda: idle(server), 15)


def test_wrong_model_and_key_are_reported_by_status(server, tmp_path, capsys):
    rc, rep = loadtest(server.url, tmp_path, "--api-key", API_KEY, "--model", "no-such-model",
                       "--requests", "3", "--clients", "2")
    assert rc == 1
    assert rep["requests"]["errors"] == 3 and list(rep["errors"]) == ["HTTP 404"]
    assert rep["errors"]["HTTP 404"]["count"] == 3 and "no-such-model" in rep["errors"]["HTTP 404"]["message"]
    assert rep["server"]["counters_delta"]['realizar_request_errors_total{status_code="404"}'] == 3
    assert "| HTTP 404 | 3 |" in capsys.readouterr().out

    rc, rep = loadtest(server.url, tmp_path, "--api-key", "wrong", "--model", "SmolLM2-135M-Instruct",
                       "--requests", "2", "--clients", "2")
    assert rc == 1 and rep["errors"]["HTTP 401"]["count"] == 2


def test_unreachable_server_is_reported_by_error_type(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"           # nothing listens there
    rc, rep = loadtest(url, tmp_path, "--model", "m", "--requests", "3", "--clients", "2")
    assert rc == 1
    assert rep["requests"]["errors"] == 3 and rep["errors"]["ConnectError"]["count"] == 3
    assert rep["server"] is None and rep["ttft_s"] is None
    capsys.readouterr()

    # without --model the model cannot be found: a one-line error, no traceback
    assert main(["loadtest", url, "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot list the models" in err and "ConnectError" in err and "Traceback" not in err


def test_bad_options_are_refused():
    assert main(["loadtest", "http://127.0.0.1:9", "--random-cancel", "1.5"]) == 2
    assert main(["loadtest", "localhost:3000"]) == 2
    assert main(["loadtest", "http://127.0.0.1:9", "--processes", "-1"]) == 2


def test_process_count_follows_the_clients():
    from realizar_backend.loadtest import CLIENTS_PER_PROCESS, LoadtestConfig
    cpus = os.cpu_count() or 1
    assert LoadtestConfig("http://x", clients=CLIENTS_PER_PROCESS).process_count == 1
    assert LoadtestConfig("http://x", clients=4 * CLIENTS_PER_PROCESS, requests=1000).process_count == min(4, cpus)
    assert LoadtestConfig("http://x", clients=64, requests=2).process_count == min(2, cpus)   # no idle processes
    assert LoadtestConfig("http://x", clients=5, processes=3).process_count == 3
    assert LoadtestConfig("http://x", clients=2, processes=8).process_count == 2
