"""tools/gpu_tests.sh, the GPU suite's runner on the device (tools/device_check.sh's tests stage), run
here on stand-in test files with a stand-in nvidia-smi: every file's outcome reported as it ends, the
queues spread over the GPUs, a failure in the exit status, and no hang under the log's tee."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# each stand-in records the GPUs it saw (CUDA_VISIBLE_DEVICES, "-" when unset)
TEST_FILE = '''import os, json, pathlib, time, pytest
pytestmark = pytest.mark.gpu
def test_it():
    pathlib.Path({seen!r}).write_text(json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES", "-")))
    time.sleep({sleep})
    assert {ok}
'''


def _files(tmp_path: Path, names: dict[str, bool]) -> list[Path]:
    out = []
    for i, (name, ok) in enumerate(names.items()):
        f = tmp_path / "gpu" / f"{name}.py"
        f.parent.mkdir(exist_ok=True)
        f.write_text(TEST_FILE.format(seen=str(tmp_path / f"{name}.seen"), sleep=0.2 * (i % 3), ok=ok))
        out.append(f)
    return out


def _run(tmp_path: Path, files: list[Path], gpus: int, **env) -> tuple[int, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {g}: stand-in (UUID: GPU-{g})'\n" for g in range(gpus)))
    smi.chmod(0o755)
    py = bin_dir / "python3"                              # the runner calls python3: this interpreter
    py.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    e = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
         "GPU_TESTS_WORK": str(tmp_path / "work"), **env}
    e.pop("CUDA_VISIBLE_DEVICES", None)
    # as device_check.sh runs it: stdout through a tee process substitution
    cmd = f'exec > >(tee -a "$OUT.log") 2>&1; bash tools/gpu_tests.sh {" ".join(map(str, files))}'
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout


def _seen(tmp_path: Path, name: str):
    return json.loads((tmp_path / f"{name}.seen").read_text())


def test_queues_spread_the_files_over_the_gpus_and_report_each(tmp_path):
    names = {"test_long_context": True, "test_a": True, "test_b": False, "test_c": True, "test_engines_gpu": True}
    rc, out = _run(tmp_path, _files(tmp_path, names), gpus=3)
    assert rc == 1                                        # test_b failed
    for name in names:
        assert any(line.startswith(f"{name} rc=") for line in out.splitlines()), (name, out)
    assert "test_b rc=1" in out and "FAILED" in out
    queued = {name: _seen(tmp_path, name) for name in names if name != "test_engines_gpu"}
    assert set(queued.values()) <= {"0", "1", "2"} and len(set(queued.values())) >= 2, queued
    assert _seen(tmp_path, "test_engines_gpu") == "-"     # after the queues, every GPU visible
    suite = ET.parse(tmp_path / "out" / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("5", "1")
    log = (tmp_path / "out" / "pytest.log").read_text()
    assert all(f"{name}.py (rc=" in log for name in names)


def test_one_queue_runs_the_files_in_order_on_the_visible_gpus(tmp_path):
    names = {"test_a": True, "test_engines_gpu": True}
    rc, out = _run(tmp_path, _files(tmp_path, names), gpus=4, GPU_QUEUES="1")
    assert rc == 0
    assert [line.split()[0] for line in out.splitlines() if line.startswith("test_")] == list(names)
    assert _seen(tmp_path, "test_a") == "-" and "(GPU" not in out


def test_files_past_the_deadline_are_reported_not_run(tmp_path):
    f = tmp_path / "gpu" / "test_slow.py"
    f.parent.mkdir()
    f.write_text("import time, pytest\npytestmark = pytest.mark.gpu\ndef test_it():\n    time.sleep(8)\n")
    later = _files(tmp_path, {"test_after": True})
    rc, out = _run(tmp_path, [f] + later, gpus=1, TESTS_DEADLINE="25")
    # the first file takes 8 s of the 25, leaving under 20 for the next: not run, and the stage fails
    assert rc == 1 and "test_after: not run (the stage's deadline)" in out
    assert not (tmp_path / "test_after.seen").exists()
