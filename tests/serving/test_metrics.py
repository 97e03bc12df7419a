"""/metrics of a real server, read with prometheus_client's parser: every realizar_ metric is
there next to BentoML's own, labelled with its worker (and the engine's series with their engine),
and after traffic each moved the right way
(the token counters by exactly the usage the clients were told).
Several engines: tests/engine/test_engine_group.py."""

from __future__ import annotations

import json

import httpx
import pytest

from support.server import sample, wait_for

from realizar_backend.serving.metrics import COUNTERS, DECODE_STARTS, GAUGES, HISTOGRAMS, VLLM, metric_names

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


def delta(after, before, name, **labels) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def test_every_metric_is_exposed_with_prometheus_names(server):
    families = server.families()
    for name in metric_names():
        assert name in families, f"{name} missing from /metrics"
    assert any(n.startswith("bentoml_") for n in families), "BentoML's own metrics are missing"
    types = {n: families[n].type for n in metric_names()}
    assert all(types["realizar_" + n.removesuffix("_total")] == "counter" for n in COUNTERS)
    assert all(types["realizar_" + n] == "histogram" for n in HISTOGRAMS)
    assert all(types["realizar_" + n] == "gauge" for n in GAUGES)
    # units in names: seconds / tokens / bytes / ratio / per_second where a unit exists
    for n in HISTOGRAMS:
        assert n.endswith(("_seconds", "_tokens"))
    assert sample(server.metrics(), "realizar_graph_status", bucket="all", status="disabled") == 1.0
    # one worker and one engine: every series says so, and the engine says where it runs
    ours = [s for f in families.values() if f.name.startswith("realizar_") for s in f.samples]
    assert ours and all(s.labels.get("worker") == "1" for s in ours)
    front = {"realizar_worker_status", "realizar_engine_status", "realizar_request_errors_total"}
    assert all(s.labels.get("engine") == "1" for s in ours if s.name not in front)
    assert server.worker_statuses() == {"1": "ready"}
    assert server.engine_statuses() == {"1": ("cpu", "ready")}
    # vLLM's names, with its model_name and engine labels
    for name, (kind, _, _) in VLLM.items():
        assert families[name].type == kind
        assert families[name].samples and all(
            s.labels.get("model_name") == MODEL and s.labels.get("engine") == "1" and s.labels.get("worker") == "1"
            for s in families[name].samples), name


def test_metrics_move_with_traffic(server):
    client = server.openai()
    before = server.metrics()
    usages = []
    r = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=6, temperature=0)
    usages.append(r.usage)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=5, temperature=0)
    usages.append(r.usage)
    chunks = list(client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count"}],
                                                 max_tokens=3, temperature=0.9, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    bad = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                     headers=server.auth, timeout=30)
    assert bad.status_code == 400

    # the engine reports a finished sequence before the last chunk reaches the client, but let
    # the refresh of the gauges catch up
    assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 10)
    after = server.metrics()
    prompt = sum(u.prompt_tokens for u in usages)
    gen = sum(u.completion_tokens for u in usages)
    k = len(usages)

    assert delta(after, before, "realizar_prompt_tokens_total") == prompt
    # every prompt was looked up in the prefix cache once (nothing was preempted and recomputed)
    assert delta(after, before, "realizar_prefix_cache_queried_tokens_total") == prompt
    assert 0 <= delta(after, before, "realizar_prefix_cache_hit_tokens_total") < prompt
    assert delta(after, before, "realizar_preemptions_total") == 0
    assert delta(after, before, "realizar_generation_tokens_total") == gen
    # one request at a time: every token after a sequence's first is one decode step, counted once
    steps = {s: delta(after, before, "realizar_decode_steps_total", start=s) for s in DECODE_STARTS}
    assert sum(steps.values()) == gen - k
    assert steps["ahead"] > 0 and 1 <= steps["start"] <= k
    # the step loop's account: each prompt (one chunk) in a step of its own, then one decode step a token
    hits = delta(after, before, "realizar_prefix_cache_hit_tokens_total")
    assert delta(after, before, "realizar_engine_step_prompt_tokens_total") == prompt - hits
    kinds = {s: delta(after, before, "realizar_engine_steps_total", kind=s) for s in ("prefill", "mixed", "decode")}
    assert kinds == {"prefill": k, "mixed": 0, "decode": gen - k}
    assert all(delta(after, before, "realizar_engine_step_seconds_total", kind=s) > 0 for s in ("prefill", "decode"))
    assert delta(after, before, "realizar_engine_idle_seconds_total") > 0
    finished = sum(delta(after, before, "realizar_requests_total", finish_reason=r) for r in ("stop", "length"))
    assert finished == k
    assert delta(after, before, "realizar_requests_total", finish_reason="abort") == 0
    assert delta(after, before, "realizar_request_errors_total", status_code="400") == 1

    for h in ("realizar_time_to_first_token_seconds", "realizar_e2e_request_latency_seconds",
              "realizar_prompt_length_tokens"):
        assert delta(after, before, h + "_count") == k
        assert delta(after, before, h + "_sum") > 0
        assert delta(after, before, h + "_bucket", le="+Inf") == k
    assert delta(after, before, "realizar_prompt_length_tokens_sum") == prompt
    # vLLM's names moved exactly as their realizar_ twins
    for name, (kind, twin, _) in VLLM.items():
        if kind == "counter":
            moved = delta(after, before, name + "_total")
            assert moved == delta(after, before, "realizar_" + twin) and (moved > 0 or "hits" in name), name
        elif kind == "histogram":
            for part in ("_count", "_sum"):
                assert delta(after, before, name + part) == pytest.approx(
                    delta(after, before, "realizar_" + twin + part)) and delta(after, before, name + part) > 0, name
    # one interval per output token after a sequence's first
    assert delta(after, before, "realizar_time_per_output_token_seconds_count") == gen - k
    # end-to-end covers first-token time
    assert (delta(after, before, "realizar_e2e_request_latency_seconds_sum")
            >= delta(after, before, "realizar_time_to_first_token_seconds_sum"))

    assert sample(after, "realizar_requests_waiting") == 0
    assert 0.0 <= sample(after, "realizar_kv_cache_usage_ratio") <= 1.0
    assert sample(after, "realizar_buffer_pool_bytes") == 0          # the CPU backend has no pools
    assert sample(after, "realizar_gpu_memory_used_bytes") == 0
    assert sample(after, "realizar_graph_status", bucket="all", status="disabled") == 1.0
    assert sample(after, "realizar_graph_replays_total") == 0      # the CPU backend has no graphs


def test_gauges_during_and_after_decoding(server):
    """Running, KV usage and decode tokens/s rise while a sequence decodes and fall after it."""
    client = server.openai()
    stream = client.completions.create(model=MODEL, prompt="List the numbers: 1, 2, 3,", max_tokens=300,
                                       temperature=0, stream=True)
    it = iter(stream)
    for _ in range(4):
        next(it)
    during = server.metrics()
    stream.close()
    assert sample(during, "realizar_requests_running") == 1
    assert sample(during, "realizar_kv_cache_usage_ratio") > 0.0
    assert sample(during, "realizar_kv_cache_used_blocks") >= 1
    assert sample(during, "realizar_kv_cache_used_tokens") > sample(during, "realizar_kv_cache_used_blocks")
    assert sample(during, "realizar_decode_tokens_per_second") > 0.0
    assert sample(during, "vllm:num_requests_running") == 1
    assert sample(during, "vllm:kv_cache_usage_perc") == sample(during, "realizar_kv_cache_usage_ratio") > 0.0

    def idle():
        m = server.metrics()
        return (sample(m, "realizar_requests_running") == 0 and sample(m, "realizar_kv_cache_usage_ratio") == 0
                and sample(m, "realizar_kv_cache_used_blocks") == 0 and sample(m, "realizar_kv_cache_used_tokens") == 0
                and sample(m, "realizar_decode_tokens_per_second") == 0)
    # decode tokens/s decays to 0 once the engine has been idle (refreshed every 2 s)
    assert wait_for(idle, 15)


def test_token_intervals_observed_in_batches_equal_one_by_one():
    """The time-per-output-token histogram gets a step's intervals together (observe_many):
    the same bucket counts and sum as observing each on its own, bounds included."""
    import prometheus_client as pc

    from realizar_backend.serving.metrics import TPOT_BUCKETS, observe_many

    values = [0.0, 1e-5, *TPOT_BUCKETS[:-1], *(b * 1.0001 for b in TPOT_BUCKETS[:-1]), 1e3, 0.0123] * 3
    one, many = pc.CollectorRegistry(), pc.CollectorRegistry()
    h1 = pc.Histogram("t", "t", buckets=TPOT_BUCKETS, registry=one)
    h2 = pc.Histogram("t", "t", buckets=TPOT_BUCKETS, registry=many)
    for v in values:
        h1.observe(v)
    observe_many(h2, values[:7])
    observe_many(h2, values[7:])

    def samples(reg):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in reg.collect() for s in f.samples
                if not s.name.endswith("_created")}
    a, b = samples(one), samples(many)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-12, abs=1e-12), k


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset"}


def dashboard_metrics(path) -> set[str]:
    """The metric names the queries of a Grafana dashboard read: identifiers outside label
    matchers, grouping clauses and strings that are not functions, keywords or numbers."""
    import json
    import re

    dash = json.loads(path.read_text())          # valid JSON, or this fails
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash.get("templating", {}).get("list", [])
              if isinstance(v.get("query"), dict)]
    names = set()
    for e in exprs:
        e = re.sub(r'"[^"]*"', "", e)
        e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", e)
        e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", e)
        e = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", e)
        for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(\s*\()?", e):
            word = m.group(0).strip()
            if not word.endswith("(") and word not in _PROMQL_WORDS:
                names.add(word)
    return names


def test_the_grafana_dashboard_reads_only_metrics_the_server_exports(server):
    from support.server import REPO

    families = server.families()
    exported = {f.name + suffix for f in families.values() for suffix in
                {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(f.type, ("",))}
    used = dashboard_metrics(REPO / "docs" / "grafana-dashboard.json")
    assert used <= exported, used - exported
    assert all(any(u.startswith(name) for u in used) for name in VLLM)      # every vLLM name has a panel


HYBRID_SLOTS = 3


@pytest.fixture(scope="module")
def hybrid():
    """A `bentoml serve` of the tiny qwen35 (tests/support/hf_oracle.py: three Gated DeltaNet
    layers and one attention layer) on the CPU, with 3 sequence slots, and its config.json."""
    pytest.importorskip("transformers")
    from support.hf_oracle import available, tiny_gguf
    from support.server import start_server
    if not available("qwen3_5"):
        pytest.skip("this transformers has no qwen3_5")
    path = tiny_gguf("qwen3_5")
    config = json.loads((path.parent / "hf" / "config.json").read_text())
    s = start_server({"REALIZAR_MODEL": str(path), "REALIZAR_MODEL_NAME": "tiny-qwen35",
                      "REALIZAR_BACKEND": "cpu", "REALIZAR_MAX_NUM_SEQS": str(HYBRID_SLOTS),
                      "REALIZAR_CONTEXT_LENGTH": "512"})
    yield s, config
    s.stop()


def test_recurrent_state_bytes_beside_the_kv_series(hybrid):
    """A hybrid's recurrent state is on /metrics: the bytes one sequence needs (by the model's
    config.json: per linear-attention layer, the conv's last kernel - 1 inputs of the q|k|v channels
    and each value head's key x value state, float32) and the bytes the engine holds for its slots
    (the CPU backend makes every slot's state at load, as the GPU backend does)."""
    server, c = hybrid
    linear = c["layer_types"].count("linear_attention")
    channels = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + c["linear_num_value_heads"] * \
        c["linear_value_head_dim"]
    per_layer = (c["linear_conv_kernel_dim"] - 1) * channels + \
        c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    per_sequence = 4 * per_layer * linear
    families = server.families()
    for name in ("realizar_recurrent_state_bytes", "realizar_recurrent_state_bytes_per_sequence"):
        assert families[name].type == "gauge" and families[name].documentation
    r = server.openai().completions.create(model="tiny-qwen35", prompt="one two three", max_tokens=4,
                                           temperature=0)
    assert r.usage.completion_tokens >= 1

    def reported():
        m = server.metrics()
        return (sample(m, "realizar_recurrent_state_bytes_per_sequence") == per_sequence
                and sample(m, "realizar_recurrent_state_bytes") == HYBRID_SLOTS * per_sequence)
    assert wait_for(reported, 15), {k: v for k, v in server.metrics().items() if "recurrent" in k[0]}
    m = server.metrics()
    assert sample(m, "realizar_recurrent_state_bytes_per_sequence", engine="1", worker="1") == per_sequence
