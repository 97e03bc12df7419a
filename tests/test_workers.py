"""Several BentoML workers in one server (one per GPU on a GPU host; REALIZAR_WORKERS on the CPU).

The worker-to-GPU mapping is plain logic, tested here for N GPUs without one. The rest runs real
`bentoml serve` processes on the CPU backend: two workers both serve requests sent on fresh
connections, and /metrics (answered by either) shows each worker's series and sums to exactly
what was sent; a worker whose load fails stands aside while the other serves; when every worker
fails, /livez says dead and requests get the error at once."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from server_util import sample, start_server, wait_for

from realizar_backend.errors import SettingsError
from realizar_backend.settings import Settings, bind_worker_gpu, serve_workers, visible_gpus, worker_gpu

MODEL = "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------ the mapping

@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_each_of_n_workers_gets_its_own_gpu(n):
    gpus = visible_gpus(n, {})                       # no CUDA_VISIBLE_DEVICES: the driver's GPUs
    assert gpus == [str(i) for i in range(n)]
    assert serve_workers(Settings(), gpus, use_gpu=True) == n
    got = [worker_gpu(w, gpus) for w in range(1, n + 1)]     # BentoML numbers workers from 1
    assert got == [str(i) for i in range(n)]
    with pytest.raises(SettingsError, match=f"worker {n + 1} has no GPU"):
        worker_gpu(n + 1, gpus)


def test_workers_follow_cuda_visible_devices_as_bentoml_sets_it():
    # BentoML gives every worker "2,3" (or the user set it, and BentoML left it alone)
    gpus = visible_gpus(8, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert gpus == ["2", "3"]
    assert serve_workers(Settings(), gpus, use_gpu=True) == 2
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    settings, gpu = bind_worker_gpu(Settings(), 2, gpus, env)
    assert (gpu, env["CUDA_VISIBLE_DEVICES"], settings.device) == ("3", "3", 0)
    # UUIDs pass through; CUDA ignores what follows an invalid (negative) entry
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "GPU-1a,GPU-2b"}) == ["GPU-1a", "GPU-2b"]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_worker_count_from_the_settings():
    assert serve_workers(Settings(workers=2), ["0", "1", "2"], use_gpu=True) == 2
    with pytest.raises(SettingsError, match="REALIZAR_WORKERS=3: one GPU per worker, and 2 are visible"):
        serve_workers(Settings(workers=3), ["0", "1"], use_gpu=True)
    # a machine without GPUs that builds the Bento for a GPU host takes the setting as it is
    assert serve_workers(Settings(workers=4), [], use_gpu=True) == 4
    assert serve_workers(Settings(), [], use_gpu=True) == 1
    # the CPU backend: as many workers as asked, one by default
    assert serve_workers(Settings(), ["0", "1"], use_gpu=False) == 1
    assert serve_workers(Settings(workers=3), [], use_gpu=False) == 3
    with pytest.raises(SettingsError, match="REALIZAR_DEVICE=1"):
        serve_workers(Settings(device=1), ["0", "1"], use_gpu=True)
    with pytest.raises(SettingsError, match="REALIZAR_WORKERS"):
        Settings.from_env({"REALIZAR_WORKERS": "-1"})


# ------------------------------------------------------------------------------ real servers

def _complete(server, i: int) -> dict:
    """One completion on a connection of its own (so that any worker may accept it)."""
    r = httpx.post(server.url + "/v1/completions", headers={**server.auth, "Connection": "close"},
                   json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _by_worker(metrics, name, **labels) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, key), v in metrics.items():
        lab = dict(key)
        if n == name and all(lab.get(k) == x for k, x in labels.items()):
            out[lab["worker"]] = out.get(lab["worker"], 0.0) + v
    return out


def _finished(metrics) -> dict[str, float]:
    return _by_worker(metrics, "realizar_requests_total")


def delta_sum(after, before, name) -> float:
    return sample(after, name) - sample(before, name)


@pytest.mark.server
@pytest.mark.slow
def test_two_workers_share_the_port_and_their_metrics_add_up():
    server = start_server({"REALIZAR_WORKERS": "2"})
    try:
        assert wait_for(lambda: server.worker_statuses() == {"1": "ready", "2": "ready"}, 120), server.log_tail()
        assert sorted(server.workers()) == [1, 2]
        before = server.metrics()
        assert sorted(_finished(before)) == ["1", "2"]          # every series carries its worker
        assert {dict(k)["device"] for (n, k), v in before.items() if n == "realizar_worker_status"} == {"cpu"}

        # concurrent requests, each on a new connection, until both workers have served some
        usages, sent = [], 0
        with cf.ThreadPoolExecutor(6) as pool:
            for _ in range(8):
                usages += pool.map(lambda i: _complete(server, i), range(sent, sent + 6))
                sent += 6
                served = {w: n - _finished(before).get(w, 0) for w, n in _finished(server.metrics()).items()}
                if len(served) == 2 and min(served.values()) > 0 and sum(served.values()) == sent:
                    break
        assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 10)

        # whichever worker answers /metrics, it shows both workers' counters, and they add up
        for _ in range(4):
            after = server.metrics()
            per = {w: n - _finished(before).get(w, 0) for w, n in _finished(after).items()}
            assert min(per.values()) > 0, f"one worker served all {sent} requests: {per}"
            assert sum(per.values()) == sent
            gen = _by_worker(after, "realizar_generation_tokens_total")
            gen0 = _by_worker(before, "realizar_generation_tokens_total")
            assert sum(gen.values()) - sum(gen0.values()) == sum(u["completion_tokens"] for u in usages)
            assert delta_sum(after, before, "realizar_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
            hist = _by_worker(after, "realizar_e2e_request_latency_seconds_count")
            assert {w: hist[w] - _by_worker(before, "realizar_e2e_request_latency_seconds_count").get(w, 0)
                    for w in hist} == per
            assert set(_by_worker(after, "realizar_requests_running")) == {"1", "2"}
    finally:
        server.stop()


@pytest.mark.server
@pytest.mark.slow
def test_a_worker_that_fails_to_load_stands_aside_and_the_other_serves(tmp_path):
    from real_models import smollm2_path
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(smollm2_path().read_bytes()[: 1 << 20])         # a download cut short
    server = start_server({"REALIZAR_WORKERS": "2"}, worker_env={2: {"REALIZAR_MODEL": str(broken)}})
    try:
        assert wait_for(lambda: server.worker_statuses() == {"1": "ready", "2": "failed"}, 120), server.log_tail()
        assert wait_for(lambda: "worker 2 of 2 (cpu) stopped accepting connections; worker(s) 1 serve"
                        in server.log_tail(400), 30), server.log_tail()
        log = server.log_tail(400)
        assert "worker 2 of 2 (cpu) cannot serve the model: ModelFormatError" in log
        failed_pid = server.workers()[2].pid

        before = server.metrics()
        with cf.ThreadPoolExecutor(4) as pool:
            usages = list(pool.map(lambda i: _complete(server, i), range(12)))    # all 200
        for _ in range(5):
            assert httpx.get(server.url + "/livez", timeout=10).status_code == 200
            assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
        after = server.metrics()
        per = {w: n - _finished(before).get(w, 0) for w, n in _finished(after).items()}
        assert per.get("1") == len(usages) and not per.get("2"), per
        # it stayed up (BentoML did not start it again) and is still reported as failed
        assert server.workers()[2].pid == failed_pid
        assert server.worker_statuses() == {"1": "ready", "2": "failed"}
    finally:
        server.stop()


@pytest.mark.server
@pytest.mark.slow
def test_when_every_worker_fails_livez_says_dead_and_requests_get_the_error(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    server = start_server({"REALIZAR_WORKERS": "2", "REALIZAR_MODEL": str(missing)}, wait_ready=False)
    try:
        assert wait_for(lambda: server.worker_statuses() == {"1": "failed", "2": "failed"}, 60), server.log_tail()
        assert wait_for(lambda: all(httpx.get(server.url + "/livez", timeout=10).status_code == 503
                                    for _ in range(4)), 30)
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 503
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        r = httpx.post(server.url + "/v1/completions", headers=server.auth,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["connection"] == "close"
        err = r.json()["error"]
        assert err["code"] == "model_not_ready" and "nowhere.gguf" in err["message"], err
        assert sorted(server.workers()) == [1, 2]                      # no worker exited
    finally:
        server.stop()
