"""The README's two set-up commands stay true: the serve command, run from a clean copy of the
checkout with no configuration, answers a curl request; the test command is what CI runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_has_the_two_commands_and_ci_runs_the_test_one():
    serve, test = BLOCKS[0].strip(), BLOCKS[1].strip()
    assert serve.startswith("pip install") and serve.endswith("bentoml serve")
    assert "pytest" in test
    test_cmd = test.split("&&")[-1].strip()
    assert test_cmd.split()[-1] == "pytest" and test_cmd in (REPO / ".ci/run").read_text().replace(
        "python3 -m pytest", "python -m pytest")


@pytest.mark.slow
@pytest.mark.server
def test_readme_serve_command_answers_curl(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, tmp_path / rel)
    # the package is already installed (by the test command); run the serve half as written
    serve = BLOCKS[0].strip().split("&&")[-1].strip()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALIZAR_")}
    env.update(BENTOML_PORT=str(port), BENTOML_DO_NOT_TRACK="true", BENTOML_HOME=str(tmp_path / ".bentoml"))
    proc = subprocess.Popen(serve, shell=True, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            r = subprocess.run(["curl", "-sf", f"{url}/readyz"], capture_output=True)
            if r.returncode == 0:
                break
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("server never became ready")
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        r = subprocess.run(["curl", "-s", f"{url}/v1/chat/completions", "-H", "content-type: application/json",
                            "-d", body], capture_output=True, text=True, timeout=120)
        answer = json.loads(r.stdout)
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
