"""tools/vllm_serve_bench.sh (device_check.sh's vllm stage), run here with a stand-in for vLLM's CLI: its
`serve` answers /health on the port, its `bench serve` writes the result file vLLM writes. The script
waits for the server, runs one unmeasured and one measured bench per concurrency (four times as many
requests as clients on the measured one), reports each, and stops the server; a server that never comes
up, or a kit that was never carried, is a clear message and a failing exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CLI = '''#!/bin/sh
case "$1" in
  serve)
    [ -n "$VLLM_TEST_DEAD" ] && exit 3
    exec {py} - "$@" <<'EOF'
import http.server, sys
a = sys.argv[1:]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(a[a.index("--port") + 1])), H).serve_forever()
EOF
    ;;
  bench)
    exec {py} - "$@" <<'EOF'
import json, os, sys
a = sys.argv[1:]
c, n = int(a[a.index("--max-concurrency") + 1]), int(a[a.index("--num-prompts") + 1])
with open(os.environ["VLLM_TEST_LOG"], "a") as f:
    f.write(json.dumps({{"model": a[a.index("--model") + 1], "c": c, "n": n, "saved": "--save-result" in a}}) + "\\n")
if "--save-result" in a:
    out = os.path.join(a[a.index("--result-dir") + 1], a[a.index("--result-filename") + 1])
    json.dump({{"output_throughput": 100.0 * c, "median_ttft_ms": 12.5, "median_itl_ms": 6.25,
               "completed": n, "failed": 0}}, open(out, "w"))
EOF
    ;;
esac
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, env_file: bool = True, **env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cli = tmp_path / "vllm"
    cli.write_text(CLI.format(py=sys.executable))
    cli.chmod(0o755)
    model = tmp_path / "models" / "qwen7"
    model.mkdir(parents=True)
    envf = tmp_path / "vllm_env.sh"
    if env_file:
        envf.write_text("export VLLM_TEST_SOURCED=1\n")
    port = _free_port()
    e = {**os.environ, "OUT": str(tmp_path / "out"), "VLLM_CLI": str(cli), "VLLM_ENV": str(envf),
         "VLLM_MODEL": str(model), "VLLM_PORT": str(port), "VLLM_CHUNKS": str(tmp_path / "chunks"),
         "VLLM_TEST_LOG": str(tmp_path / "bench.log"), "VLLM_START_S": "20", **env}
    r = subprocess.run(["bash", "tools/vllm_serve_bench.sh"], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=60)
    log = tmp_path / "bench.log"
    return r, [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else [], port


def test_each_concurrency_is_warmed_measured_and_reported(tmp_path):
    r, runs, port = _run(tmp_path, VLLM_CONCURRENCY="16 64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(x["c"], x["n"], x["saved"]) for x in runs] == [(16, 16, False), (16, 64, True),
                                                            (64, 64, False), (64, 256, True)]
    assert {x["model"] for x in runs} == {str(tmp_path / "models" / "qwen7")}
    report = json.loads((tmp_path / "out" / "vllm.json").read_text())
    assert report["c64"] == {"output_tok_s": 6400.0, "ttft_p50_ms": 12.5, "itl_p50_ms": 6.25,
                             "completed": 256, "failed": 0}
    assert "VLLM c16: 1,600.0 output tok/s, TTFT p50 12.5 ms, ITL p50 6.25 ms, 64 completed, 0 failed" in r.stdout
    # the server is stopped on the way out: nothing listens on its port (SO_REUSEADDR: the closed
    # connections' TIME_WAIT does not count)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_server_that_never_comes_up_or_a_missing_kit_fails_clearly(tmp_path):
    r, runs, _ = _run(tmp_path / "dead", VLLM_TEST_DEAD="1")
    assert r.returncode == 1 and "vllm: the server did not come up" in r.stdout and runs == []
    r, runs, _ = _run(tmp_path / "nokit", env_file=False)
    assert r.returncode == 1 and "vllm: no " in r.stdout and "install.sh (carry the kit's parts first)" in r.stdout
