"""A server's life outside single requests, each with real `bentoml serve` processes: a bad
setting stops the start naming its variable; SIGTERM drains (new requests 503, running streams
ended with a final chunk at the grace period) and the process exits soon after; two servers on
one host with the same BentoML home keep their own metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from support.server import CONTEXT, start_server, wait_for

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
GRACE_S = 4


@pytest.mark.parametrize("env, line", [
    ({"REALIZAR_MAX_WAITING": "0"}, "realizar: REALIZAR_MAX_WAITING=0: must be at least 1"),
    ({"REALIZAR_MAX_WAITING": "-5"}, "realizar: REALIZAR_MAX_WAITING=-5: must be at least 1"),
    ({"REALIZAR_SHUTDOWN_GRACE_S": "soon"}, "realizar: REALIZAR_SHUTDOWN_GRACE_S='soon': not a number"),
    ({"REALIZAR_MAX_NUM_SEQ": "4"}, "realizar: REALIZAR_MAX_NUM_SEQ: no such setting; did you mean "
                                    "REALIZAR_MAX_NUM_SEQS?")])
def test_a_bad_setting_stops_the_start_with_one_line_naming_it(env, line):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        start_server(env, timeout=120)
    assert line in str(e.value).splitlines(), str(e.value)[-2000:]
    assert "Traceback" not in str(e.value)
    assert time.monotonic() - t0 < 120


def _serve_once(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    import sys
    from support.server import REPO
    base = [sys.executable, "-m", "bentoml", "serve", "service:Realizar"] if cmd[0] == "bentoml" else \
        [sys.executable, "-m", "realizar_backend.cli", "serve"]
    return subprocess.run(base + cmd[1:], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "REALIZAR_BACKEND": "cpu", "BENTOML_DO_NOT_TRACK": "true", **env})


@pytest.mark.parametrize("command", ["bentoml", "realizar"])
def test_a_port_in_use_is_one_line_and_a_non_zero_exit(command):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve_once([command, "--host", "127.0.0.1", "--port", str(port)], {})
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert f"realizar: cannot listen on 127.0.0.1:{port}: the address is in use" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("engines", [1, 2])
def test_a_server_that_cannot_load_its_model_exits_with_one_line(tmp_path, engines):
    missing = tmp_path / "nowhere.gguf"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        start_server({"REALIZAR_MODEL": str(missing), "REALIZAR_WORKERS": str(engines)}, timeout=120)
    log = str(e.value)
    errors = [line for line in log.splitlines() if "cannot serve the model" in line]
    assert len(errors) == 1 and f"ModelFormatError: {missing}: no such file" in errors[0], log[-2000:]
    assert "Traceback" not in log
    assert time.monotonic() - t0 < 60


def _stream(server, body, out: dict) -> None:
    """Read an SSE stream to its end, recording every data line and when the stream ended."""
    lines = out.setdefault("lines", [])
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.auth, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
    out["ended"] = time.monotonic()


def test_sigterm_drains_then_ends_running_streams_and_exits():
    server = start_server({"REALIZAR_SHUTDOWN_GRACE_S": str(GRACE_S)})
    try:
        long = {"model": MODEL, "prompt": "Count slowly to one thousand:", "max_tokens": CONTEXT - 32,
                "ignore_eos": True, "temperature": 0}
        streams = [{} for _ in range(2)]
        threads = [threading.Thread(target=_stream, args=(server, {**long, "stream": True,
                                                                   "stream_options": {"include_usage": True}}, s))
                   for s in streams]
        full: dict = {}

        def full_request():
            r = httpx.post(server.url + "/v1/completions", json=long, headers=server.auth, timeout=120)
            full.update(status=r.status_code, body=r.json(), ended=time.monotonic())

        threads.append(threading.Thread(target=full_request))
        for t in threads:
            t.start()
        assert wait_for(lambda: all(len(s.get("lines", [])) >= 2 for s in streams), 120), server.log_tail()

        t0 = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        # new requests are refused at once, on a new connection, while the streams run on
        r = httpx.post(server.url + "/v1/completions", json={**long, "max_tokens": 2}, headers=server.auth,
                       timeout=10)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 503
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503     # vLLM's probe agrees
        assert httpx.get(server.url + "/livez", timeout=10).status_code == 200
        assert all("ended" not in s for s in streams), "a stream ended before the grace period"

        for t in threads:
            t.join(GRACE_S + 30)
        for s in streams:
            assert s["status"] == 200
            assert s["lines"][-1] == "[DONE]", s["lines"][-3:]
            chunks = [json.loads(x) for x in s["lines"][:-1]]
            finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
            usage = chunks[-1]["usage"]
            assert 0 < usage["completion_tokens"] < long["max_tokens"], usage     # cut short, and counted
            assert GRACE_S - 0.5 <= s["ended"] - t0 <= GRACE_S + 8
        assert full["status"] == 200 and full["body"]["choices"][0]["finish_reason"] == "length"
        assert 0 < full["body"]["usage"]["completion_tokens"] < long["max_tokens"]

        server.proc.wait(timeout=GRACE_S + 30)
        exited = time.monotonic() - t0
        assert exited <= GRACE_S + 10, f"exited {exited:.1f} s after SIGTERM (grace {GRACE_S} s)"
        assert "ending 3 requests with a final chunk" in server.log_tail(200)
    finally:
        server.stop()


def _finished(server) -> float:
    return sum(v for (name, _), v in server.metrics().items() if name == "realizar_requests_total")


def _complete(server, n: int) -> None:
    for _ in range(n):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       headers=server.auth, timeout=120)
        assert r.status_code == 200, r.text


def test_two_servers_on_one_home_keep_their_own_metrics(tmp_path):
    home = tmp_path / "bentoml"
    a = start_server(bentoml_home=home)
    try:
        _complete(a, 3)
        assert wait_for(lambda: _finished(a) == 3, 30), a.metrics()
        b = start_server(bentoml_home=home)
        try:
            assert _finished(a) == 3 and _finished(b) == 0
            _complete(b, 1)
            assert wait_for(lambda: _finished(b) == 1, 30)
            assert _finished(a) == 3
        finally:
            b.stop()
        _complete(a, 1)
        assert wait_for(lambda: _finished(a) == 4, 30)
    finally:
        a.stop()


@pytest.mark.parametrize("config, traced", [(None, False), ("tracing:\n  exporter_type: in_memory\n", True),
                                            ("tracing:\n  excluded_urls: [/metrics]\n", True)])
def test_openai_routes_are_traced_only_where_spans_go_somewhere(tmp_path, config, traced):
    """Without a tracing exporter BentoML's middleware would open a span per SSE chunk for nothing,
    so the service leaves /v1 out; a configured exporter or exclusion list is kept as given."""
    import subprocess
    import sys

    env = {**os.environ, "REALIZAR_BACKEND": "cpu"}
    env.pop("BENTOML_CONFIG", None)
    if config is not None:
        (tmp_path / "bentoml.yaml").write_text(config)
        env["BENTOML_CONFIG"] = str(tmp_path / "bentoml.yaml")
    # inject_config: what a worker does when it builds the service's app (after the import)
    probe = ("from realizar_backend.serving.service import Realizar\n"
             "Realizar.inject_config()\n"
             "from bentoml._internal.configuration.containers import BentoMLContainer as C\n"
             "ex = C.tracing_excluded_urls.get()\n"
             "print(ex.url_disabled('http://127.0.0.1:3000/v1/chat/completions'),"
             " ex.url_disabled('http://127.0.0.1:3000/readyz'))\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(not traced), "False"]


def test_the_worker_and_its_engines_end_with_a_killed_server_and_free_the_port():
    """SIGKILL the server's main process (BentoML's arbiter): its worker (in a session of its own)
    and the worker's engine processes end too, and the port is free within seconds."""
    import psutil
    import socket

    server = start_server()
    children = psutil.Process(server.proc.pid).children(recursive=True)
    try:
        assert server.worker() and any("realizar_backend.engine.process" in " ".join(p.cmdline()) for p in children)
        port = int(server.url.rsplit(":", 1)[1])
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, [p.cmdline() for p in alive]

        def port_free() -> bool:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                    return True
                except OSError:
                    return False

        assert wait_for(port_free, 5)
    finally:
        for p in children:           # what a failure left running
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        server.stop()


def test_bentoml_serve_listens_on_this_machine_only_unless_asked():
    import psutil

    server = start_server(host=None)
    try:
        port = int(server.url.rsplit(":", 1)[1])
        conns = (getattr(psutil.Process(server.proc.pid), "net_connections", None)
                 or psutil.Process(server.proc.pid).connections)(kind="inet")
        listening = {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening
        assert wait_for(lambda: f"listening on 127.0.0.1 port {port}" in server.log_tail(200), 10), server.log_tail()
    finally:
        server.stop()
