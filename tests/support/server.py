"""A real `bentoml serve` process for the server tests.

`shared_server()` starts one server per test process (CPU backend, the default SmolLM2 model,
an API key) on a free local port and waits for /readyz; every server test module uses it, so
the model loads once per pytest run. `shared_qwen_server()` is the same for Qwen2.5-Coder-0.5B
(the tool-calling and structured-output tests). The processes are stopped at interpreter exit.

`Server.engines()` finds the engine processes behind the server's front ends (one per GPU, or
REALIZAR_WORKERS on the CPU), and `engine_statuses()` what /metrics says of each.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
MAX_NUM_SEQS = 16
MAX_WAITING = 16        # a burst of 16 clients all wait before the engine's next step admits them
CONTEXT = 512

SERVER_ENV = {
    "REALIZAR_BACKEND": "cpu",
    "REALIZAR_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
    "REALIZAR_MAX_WAITING": str(MAX_WAITING),
    "REALIZAR_CONTEXT_LENGTH": str(CONTEXT),
    "REALIZAR_API_KEY": API_KEY,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def exit_report(self) -> str:
        """Why the server exited: the log's error lines (two engines' start-up lines can push them
        out of the tail), then its tail."""
        lines = self.log_text().splitlines()
        errors = [ln for ln in lines[:-60] if any(w in ln for w in ("Error", "Traceback", "Could not", "ERROR"))]
        return "\n".join([*errors[:40], *(["..."] if errors else []), *lines[-60:]])

    def openai(self, **kw):
        import openai
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 300)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels): value}, through prometheus_client's parser."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def families(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def _processes(self, *markers: str) -> list:
        import psutil
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if any(m in part for part in p.cmdline() for m in markers)]

    def workers(self) -> list:
        """The BentoML worker processes, the front ends (psutil.Process)."""
        return self._processes("_bentoml_impl.worker")

    def worker(self):
        """The first front end (a psutil.Process)."""
        found = self.workers()
        if not found:
            raise RuntimeError("no worker process under the server")
        return found[0]

    def engines(self) -> list:
        """The engine processes (psutil.Process) in their order: the one front end's children, or,
        with several front ends, the serving process's (engine/shared.py)."""
        return sorted(self._processes("realizar_backend.engine.process", "realizar_backend.engine.shared"),
                      key=lambda p: int(p.cmdline()[-1]))

    def worker_statuses(self) -> dict[str, str]:
        """{worker: loading | ready | failed} from realizar_worker_status on /metrics."""
        return {labels["worker"]: labels["status"] for (name, key), v in self.metrics().items()
                if name == "realizar_worker_status" and v == 1.0 for labels in [dict(key)]}

    def engine_statuses(self) -> dict[str, tuple[str, str]]:
        """{engine: (device, ready | stuck | dead | failed)} from realizar_engine_status on /metrics."""
        return {labels["engine"]: (labels["device"], labels["status"]) for (name, key), v in self.metrics().items()
                if name == "realizar_engine_status" and v == 1.0 for labels in [dict(key)]}

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        # the server runs in its own session: signal its group (arbiter and workers) by id
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


_BIND_ATTEMPTS = 3


def _lost_its_port(server: Server, within_s: float = 30.0) -> bool:
    """True when the server exited because its port was taken (BentoML's arbiter binds it first,
    within seconds of the start); False once it listens, or exits for any other reason."""
    import psutil

    port = int(server.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return "Could not bind" in server.log_text()
        try:
            proc = psutil.Process(server.proc.pid)
            conns = (getattr(proc, "net_connections", None) or proc.connections)(kind="tcp")   # psutil < 6: connections
        except psutil.Error:
            conns = []
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return False
        time.sleep(0.2)
    return False


def start_server(env: dict[str, str] | None = None, timeout: float = 240.0,
                 bentoml_home: Path | None = None,
                 wait_ready: bool = True, nofile: int | None = None, host: str | None = "127.0.0.1") -> Server:
    """A server on a free port; its own BentoML home unless `bentoml_home` names a shared one.
    wait_ready=False
    returns once the server answers /livez, ready or not. nofile: the server's open-file limit
    (its soft RLIMIT_NOFILE), as a machine with a small one would have. host: `--host` (None:
    none given, the service's default)."""
    home = Path(tempfile.mkdtemp(prefix="realizar-serve-"))
    full_env = {**os.environ, **SERVER_ENV, **(env or {}),
                "BENTOML_HOME": str(bentoml_home or home / "bentoml"), "BENTOML_DO_NOT_TRACK": "true"}
    log_path = home / "serve.log"
    # free_port's port comes from the ephemeral range, which the suite's own client connections
    # draw from too: one may take it before the server binds it; then the server starts on another
    for attempt in range(_BIND_ATTEMPTS):
        port = free_port()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "bentoml", "serve", "service:Realizar", *(["--host", host] if host else []),
                 "--port", str(port)],
                cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=None if nofile is None else lambda: _limit_files(nofile))
        server = Server(f"http://127.0.0.1:{port}", proc, log_path, full_env.get("REALIZAR_API_KEY"))
        if not _lost_its_port(server):
            break
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bentoml serve exited with {proc.returncode}:\n{server.exit_report()}")
        try:
            if wait_ready and httpx.get(server.url + "/readyz", timeout=5).status_code == 200:
                return server
            if not wait_ready:
                httpx.get(server.url + "/livez", timeout=5)
                return server
        except httpx.HTTPError:
            pass            # not listening yet
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{server.log_tail()}")


def model_server(path: str | Path, name: str, **env: str) -> Iterator[Server]:
    """For a module's own `server` fixture (`yield from model_server(path, name)`): a server of the
    model file at `path`, served as `name`, with a context of 4096 tokens and two sequences at once
    (env: other settings), stopped after the module."""
    s = start_server({"REALIZAR_MODEL": str(path), "REALIZAR_MODEL_NAME": name,
                      "REALIZAR_CONTEXT_LENGTH": "4096", "REALIZAR_MAX_NUM_SEQS": "2", **env})
    yield s
    s.stop()


def tiny_model_server(tmp_path_factory, head: str, write, name: str, **env: str) -> Iterator[Server]:
    """model_server of the tiny random model that `write(path)` makes with the real tokenizer of
    shared/models/HEAD.head.gz (tests/support/gptoss_model.py, qwen35_model.py); the module is
    skipped where that head is not here."""
    import pytest
    from support.gguf_kv import shared_head
    if shared_head(head) is None:
        pytest.skip(f"shared/models/{head}.head.gz is not here")
    yield from model_server(write(tmp_path_factory.mktemp(head) / f"{head}.gguf"), name, **env)


def guided_chat(client, grammar: str | None, *, model: str, messages: list, **kw):
    """A chat completion through the `openai` client at temperature 0 (max_tokens 80 unless given),
    its output held by the Lark `grammar` (guided_grammar, beside any other extra_body; None: not
    held). A module binds its model and messages: `chat = functools.partial(guided_chat, model=MODEL,
    messages=USER)`."""
    kw.setdefault("max_tokens", 80)
    extra = kw.pop("extra_body", {})
    if grammar:
        extra = {"guided_grammar": grammar, **extra}
    return client.chat.completions.create(model=model, messages=messages, temperature=0, extra_body=extra, **kw)


def _limit_files(n: int) -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


_shared: dict[str, Server] = {}

QWEN_MODEL = "qwen2.5-coder-0.5b"


def shared_server() -> Server:
    """The one SmolLM2 server of this test process (started on first use, stopped at exit)."""
    return _shared_server("smol", dict)


def shared_qwen_server() -> Server:
    """The one Qwen2.5-Coder-0.5B server of this test process (tools, structured output, client
    libraries; served as QWEN_MODEL), started on first use and stopped at exit."""
    def env() -> dict[str, str]:
        from support.real_models import real_model
        return {"REALIZAR_MODEL": str(real_model("qwen05")), "REALIZAR_MODEL_NAME": QWEN_MODEL,
                "REALIZAR_CONTEXT_LENGTH": "1024", "REALIZAR_MAX_NUM_SEQS": "20", "REALIZAR_MAX_WAITING": "32",
                # few, so that tests/serving/test_agent_apis.py sees the Responses store drop its oldest
                "REALIZAR_RESPONSES_STORE_SIZE": "4"}
    return _shared_server("qwen", env)


def _shared_server(key: str, env) -> Server:
    server = _shared.get(key)
    if server is None or server.proc.poll() is not None:
        server = _shared[key] = start_server(env())
        atexit.register(server.stop)
    return server


def warm(server, timeout: float = 120.0) -> None:
    """Wait out a fresh server's one-time work (llguidance's vocabulary, built on a thread a
    second after ready in the worker and in its engine process, holds the GIL for up to seconds:
    a server with a short REALIZAR_ENGINE_STALL_TIMEOUT_S may call its engine stuck meanwhile and
    answer 503): a guided request needs it built."""
    def served():
        r = httpx.post(server.url + "/v1/completions", headers=server.auth, timeout=120,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Yes or no?", "max_tokens": 1,
                             "guided_choice": ["yes", "no"]})
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200
    assert wait_for(served, timeout, interval=1.0), "the server did not serve a guided request"


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    """Poll until predicate() is truthy; returns its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def sample(metrics: dict, name: str, **labels) -> float:
    """The value of `name` with these labels, summed over the labels not named: over the
    server's workers, unless `worker=` names one."""
    want = set(labels.items())
    return sum(v for (n, key), v in metrics.items() if n == name and want <= set(key))


SMOL_MODEL = "SmolLM2-135M-Instruct"           # the default model's served name


def count_to(server, i: int, model: str = SMOL_MODEL) -> dict:
    """A greedy completion of "Count to I:" (8 tokens at most), answered 200; its usage."""
    r = httpx.post(server.url + "/v1/completions", headers=server.auth,
                   json={"model": model, "prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@dataclass
class MetricsDelta:
    """Two Server.metrics() scrapes; called as delta(name, **labels): how much `name` grew between
    them (summed as `sample` sums)."""
    before: dict
    after: dict

    def __call__(self, name: str, **labels) -> float:
        return sample(self.after, name, **labels) - sample(self.before, name, **labels)

    def finished_by_engine(self, engines=("1", "2")) -> list[float]:
        """The requests each engine finished (their length or a stop) between the scrapes."""
        return [sum(self("realizar_requests_total", engine=e, finish_reason=r) for r in ("length", "stop"))
                for e in engines]


def counted_burst(server, n: int, settle_s: float = 0.0) -> tuple[list[dict], MetricsDelta]:
    """n count_to requests, six at a time, between two scrapes of /metrics (the second once none
    runs, and settle_s later); asserts that the engines' events and reports add up to exactly what
    was served (requests finished, tokens generated, prompt tokens). Returns (usages, delta)."""
    import concurrent.futures as cf
    before = server.metrics()
    with cf.ThreadPoolExecutor(6) as pool:
        usages = list(pool.map(lambda i: count_to(server, i), range(n)))
    assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 10)
    time.sleep(settle_s)
    delta = MetricsDelta(before, server.metrics())
    assert delta("realizar_requests_total", finish_reason="length") + delta(
        "realizar_requests_total", finish_reason="stop") == len(usages)
    assert delta("realizar_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("realizar_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    return usages, delta


class LivezProbe:
    """Polls /livez from a separate process (so that nothing the test process does delays it)
    over one keep-alive connection, and reports each answer's latency.

        with LivezProbe(server.url) as probe:
            ...attack...
        assert probe.worst() < 0.1
    """

    _SCRIPT = r"""
import json, os, select, socket, sys, time
try:
    os.nice(-5)          # where allowed: the probe's own scheduling should not be what it measures
except OSError:
    pass
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
out, buf = [], b""
while not select.select([sys.stdin], [], [], 0)[0]:          # until the parent says stop
    t0 = time.perf_counter()
    s.sendall(b"GET /livez HTTP/1.1\r\nHost: probe\r\n\r\n")
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    n = next(int(l.split(b":")[1]) for l in lines if l.lower().startswith(b"content-length:"))
    while len(buf) < n:
        buf += s.recv(65536)
    buf = buf[n:]
    out.append((lines[0].split(b" ")[1].decode(), time.perf_counter() - t0))
    time.sleep(0.01)
print(json.dumps(out))
"""

    def __init__(self, url: str):
        host, port = url.rsplit("//", 1)[1].split(":")
        self.args = [sys.executable, "-c", self._SCRIPT, host, port]
        self.samples: list[tuple[str, float]] = []

    def __enter__(self) -> "LivezProbe":
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        time.sleep(0.3)          # connected and answering before the attack starts
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(b"stop\n", timeout=60)
        self.samples = [tuple(x) for x in json.loads(out)]

    def worst(self) -> float:
        return max(t for _, t in self.samples)

    def late(self, bound: float) -> list[tuple[int, str, float]]:
        """(index, status, seconds) of every answer slower than `bound`."""
        return [(i, s, t) for i, (s, t) in enumerate(self.samples) if t > bound]

    def statuses(self) -> set[str]:
        return {code for code, _ in self.samples}
