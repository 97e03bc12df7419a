"""tools/peers.sh (device_check.sh's peers stage), run here with stand-ins for the GPU machine's parts:
nvidia-smi lists the GPUs, `python3 -m realizar_backend.cli bench` and make_quant_twins.py's expand write what the
real ones would, and PEER_LLAMACPP stands for llama.cpp's benchmarks. The twins spread over the GPUs'
queues, each twin's figures reach peers.json and its line, a twin the script expanded is deleted,
one it found is kept, and no twin starts past the deadline."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# python3 on the PATH: bench and twin expansion stand-ins, anything else the real interpreter
PYTHON = '''#!/bin/sh
case "$*" in
  "-m realizar_backend.cli bench"*)
    exec {py} - "$@" <<'EOF'
import json, os, sys
a = sys.argv[1:]
model, out = a[a.index("--model") + 1], a[a.index("--json") + 1]
b = int(a[a.index("--batch") + 1]) if "--batch" in a else 1
log = os.environ["PEER_TEST_LOG"]
with open(log, "a") as f:
    f.write(json.dumps({{"model": os.path.basename(model), "batch": b,
                         "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "-")}}) + "\\n")
json.dump({{"tg_tok_s": {{"median": 100.0 * b}}, "pp_tok_s": {{"median": 5000.0}}}}, open(out, "w"))
EOF
    ;;
  *make_quant_twins.py\ expand*) echo twin > "$4"; exit 0 ;;
  *) exec {py} "$@" ;;
esac
'''
LLAMACPP = '''#!/bin/sh
cat > "$OUT/llamacpp.json" <<EOF
{"summary": {"tg128": 50.0, "pp512": 2500.0, "batched_pp128_tg128_b16": 800.0, "batched_pp128_tg128_b64": 3200.0},
 "model": "$LLAMACPP_MODEL"}
EOF
'''


def _run(tmp_path: Path, twins: list[str], gpus: int, heads=(), keep=(), **env):
    """peers.sh on `twins` with `gpus` stand-in GPUs; heads: twins whose head is in the twins directory,
    keep: twins already expanded. Returns the process, peers.json, the models directory."""
    tmp_path.mkdir(exist_ok=True)
    b = tmp_path / "bin"
    b.mkdir()
    (b / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {g}: stand-in'\n" for g in range(gpus)))
    (b / "python3").write_text(PYTHON.format(py=sys.executable))
    (tmp_path / "llama.sh").write_text(LLAMACPP)
    for f in (b / "nvidia-smi", b / "python3", tmp_path / "llama.sh"):
        f.chmod(0o755)
    tw, models = tmp_path / "twins", tmp_path / "models"
    tw.mkdir()
    models.mkdir()
    for n in heads:
        with gzip.open(tw / f"{n}.head.gz", "wb") as f:
            f.write(b"head")
        (tw / f"{n}.json").write_text("{}")
    for n in keep:
        (models / f"{n}.gguf").write_text("kept")
    e = {**os.environ, "PATH": f"{b}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
         "PEER_WORK": str(tmp_path / "work"), "PEER_TWINS_DIR": str(tw), "PEER_MODELS": str(models),
         "PEER_TEST_LOG": str(tmp_path / "bench.log"), "PEER_LLAMACPP": f"sh {tmp_path / 'llama.sh'}", **env}
    e.pop("CUDA_VISIBLE_DEVICES", None)
    if e["PEER_LLAMACPP"] == "":
        del e["PEER_LLAMACPP"]
    r = subprocess.run(["bash", "tools/peers.sh", *twins], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=120)
    out = tmp_path / "out" / "peers.json"
    return r, (json.loads(out.read_text()) if out.exists() else {}), models


def _runs(tmp_path: Path) -> list[dict]:
    log = tmp_path / "bench.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_twins_spread_over_the_gpus_and_report_ours_beside_llama_cpp(tmp_path):
    twins = ["big", "small", "third"]
    r, report, models = _run(tmp_path, twins, gpus=2, heads=("big", "third"), keep=("small",))
    assert r.returncode == 0, r.stderr
    runs = _runs(tmp_path)
    # each twin on its queue's GPU (twin i on GPU i mod 2): a prompt + decode run, then 16 and 64 streams
    assert sorted((x["model"], x["batch"]) for x in runs) == sorted((f"{n}.gguf", b) for n in twins
                                                                      for b in (1, 16, 64))
    for i, n in enumerate(twins):
        assert {x["gpu"] for x in runs if x["model"] == f"{n}.gguf"} == {str(i % 2)}
        assert report[n]["ours"] == {"tg128": 100.0, "pp512": 5000, "b16": 1600.0, "b64": 6400.0}
        assert report[n]["llamacpp"] == {"tg128": 50.0, "pp512": 2500.0, "b16": 800.0, "b64": 3200.0}
        assert (f"PEERS {n}: tg128 100.0 / 50.0 (2.00x), pp512 5000 / 2500.0 (2.00x), "
                f"b16 1600.0 / 800.0 (2.00x), b64 6400.0 / 3200.0 (2.00x)") in r.stdout
    # the twins it expanded are deleted after their run, the one it found stays
    assert sorted(p.name for p in models.glob("*.gguf")) == ["small.gguf"]


def test_no_twin_starts_past_the_deadline_and_a_missing_head_is_reported(tmp_path):
    r, report, _ = _run(tmp_path / "late", ["big"], gpus=1, heads=("big",), PEER_DEADLINE="0")
    assert r.returncode == 0, r.stderr
    assert _runs(tmp_path / "late") == []
    assert report["big"]["error"] == "peers: past the deadline" and report["big"]["ours"] == {}
    assert "PEERS big: tg128 - / -, pp512 - / -" in r.stdout and "[peers: past the deadline]" in r.stdout
    r, report, _ = _run(tmp_path / "none", ["no_such_twin"], gpus=1)
    assert r.returncode == 0, r.stderr
    assert report["no_such_twin"]["error"].startswith("peers: no no_such_twin.head.gz in ")


def test_peer_gpus_names_the_queues_gpus(tmp_path):
    """PEER_GPUS: the twins go only to the GPUs named (a queue each), the others stay free."""
    twins = ["a", "b", "c"]
    r, report, _ = _run(tmp_path, twins, gpus=4, heads=twins, PEER_GPUS="3 1")
    assert r.returncode == 0, r.stderr
    assert {n: {x["gpu"] for x in _runs(tmp_path) if x["model"] == f"{n}.gguf"} for n in twins} == \
        {"a": {"3"}, "b": {"1"}, "c": {"3"}}
    assert all(report[n]["ours"]["tg128"] == 100.0 for n in twins)


LLAMA_BENCH = """#!/bin/sh
echo "$CUDA_VISIBLE_DEVICES $*" >> "$LLAMA_TEST_LOG"
echo '| stand-in |' >&2
echo '[{"n_prompt": 512, "n_gen": 0, "avg_ts": 2500.0, "samples_ts": [2400.0, 2500.0, 2600.0]},
      {"n_prompt": 0, "n_gen": 128, "avg_ts": 50.0, "samples_ts": [50.0, 50.0, 50.0]}]'
"""
BATCHED_BENCH = """#!/bin/sh
echo "$CUDA_VISIBLE_DEVICES $*" >> "$LLAMA_TEST_LOG"
for b in 1 16 64; do
  echo "{\\"n_kv_max\\": 1, \\"pp\\": 128, \\"tg\\": 128, \\"pl\\": $b, \\"n_kv\\": 1, \\"speed_pp\\": 1.0, \\"speed_tg\\": $((b * 50)).0, \\"speed\\": 1.0}"
done
"""


def test_the_queues_share_one_llama_cpp_build(tmp_path):
    """Without PEER_LLAMACPP: llama.cpp is built (here: no kit, so it is not) once in PEER_LLAMACPP_WORK,
    and every queue's twins run its programs from there (tools/llama_cpp_bench.sh bench), each twin's
    raw results apart: both GPUs' figures reach peers.json."""
    bin_ = tmp_path / "llamacpp" / "build" / "bin"
    bin_.mkdir(parents=True)
    for name, text in (("llama-bench", LLAMA_BENCH), ("llama-batched-bench", BATCHED_BENCH)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    twins = ["a", "b"]
    r, report, _ = _run(tmp_path / "run", twins, gpus=2, heads=twins, PEER_LLAMACPP="",
                        PEER_LLAMACPP_WORK=str(tmp_path / "llamacpp"), LLAMACPP_KIT=str(tmp_path / "no-kit"),
                        LLAMA_TEST_LOG=str(tmp_path / "llama.log"))
    assert r.returncode == 0, r.stderr
    assert "peers: llama.cpp not built" in r.stdout
    for n in twins:
        assert report[n]["llamacpp"] == {"tg128": 50.0, "pp512": 2500.0, "b16": 800.0, "b64": 3200.0}, report[n]
    calls = (tmp_path / "llama.log").read_text().splitlines()
    assert sorted(c.split()[0] for c in calls) == ["0", "0", "1", "1"]
