#!/usr/bin/env bash
# THE device script: everything the GPU machine checks, in one call, with a report under $OUT.
#   1. installs the carried wheels (.whl/, from /work/shared/tools/device_wheels.sh) into /tmp/site
#   2. expands the shape twins (.twins/NAME.head + NAME.json + twin_expand.py) into /tmp/twins
#   3. assembles the real SmolLM2 from parts carried in earlier calls (.device/smol.part*,
#      staged in /tmp/stage while the machine stays warm); `device_check.sh stage` only stages
#   4. runs `pytest -m gpu` (no -x: the full report), then a decode/prefill timing of each twin,
#      then `realizar bench` on the twins when the CLI has it
# Output: $OUT/log (everything), $OUT/junit.xml, $OUT/pytest.log, $OUT/bench.json, $OUT/summary.json
set -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/.device/out}
mkdir -p "$OUT" /tmp/stage /tmp/twins
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log") 2>&1
cd "$REPO"

echo "== $(date -u +%FT%TZ) device_check ${1:-full}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# 3. stage real SmolLM2 parts (each call can carry one part: the file is over one call's limit)
for p in .device/smol.part*; do [ -f "$p" ] && cp -f "$p" /tmp/stage/ && echo "staged $p"; done
SMOL=/tmp/smol135.gguf
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f "$SMOL" ] && ls /tmp/stage/smol.partA /tmp/stage/smol.partB >/dev/null 2>&1; then
  cat /tmp/stage/smol.partA /tmp/stage/smol.partB > "$SMOL.tmp"
  if [ "$(sha256sum "$SMOL.tmp" | cut -d' ' -f1)" = "$SMOL_SHA" ]; then mv "$SMOL.tmp" "$SMOL"; echo "real SmolLM2 assembled"
  else echo "real SmolLM2 parts do not match the sha256"; rm -f "$SMOL.tmp"; fi
fi
[ "${1:-full}" = stage ] && { ls -la /tmp/stage; exit 0; }

# 1. wheels
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import cupy, gguf, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" || exit 1

# 2. twins
export REALIZAR_TWINS=/tmp/twins
for n in smol135 qwen05 gemma270 qwen15; do
  if [ -f .twins/$n.head ] && [ ! -f /tmp/twins/$n.gguf ]; then
    python3 .twins/twin_expand.py .twins/$n /tmp/twins/$n.gguf || echo "twin $n failed"
  fi
done
[ -f "$SMOL" ] && export REALIZAR_REAL_SMOL=$SMOL

# 4. tests
t0=$(date +%s)
python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -rA -q -s --durations=15 \
  --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
rc=$?
echo "pytest rc=$rc in $(( $(date +%s) - t0 )) s"

# timing: batch-1 greedy decode (graph replay, 4 bytes back per token) and a 512-token prefill
python3 - "$OUT/bench.json" <<'PY' || echo "bench failed"
import json, sys, time, logging
from pathlib import Path
import numpy as np
from realizar_backend.backends.base import PrefillItem
from realizar_backend.backends.cuda import CUDABackend
from realizar_backend.formats import open_model
from realizar_backend.settings import Settings
logging.basicConfig(level=logging.WARNING)
res = {}
for name in ("smol135", "qwen05", "gemma270", "qwen15"):
    p = Path("/tmp/twins") / f"{name}.gguf"
    if not p.exists():
        continue
    m = open_model(p)
    be = CUDABackend(m, max_slots=1, max_context=1024, settings=Settings(self_check=False))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.config.vocab_size, 512).astype(np.int32)
    be.prefill([PrefillItem(0, prompt)])
    t = time.perf_counter(); be.prefill([PrefillItem(0, prompt)]); pp = 512 / (time.perf_counter() - t)
    tok = 1
    for i in range(16):
        tok = int(be.decode_argmax([0], [tok], [512 + i])[0])
    t = time.perf_counter()
    for i in range(128):
        tok = int(be.decode_argmax([0], [tok], [528 + i])[0])
    tg = 128 / (time.perf_counter() - t)
    res[name] = {"pp512_tok_s": round(pp, 1), "tg128_tok_s": round(tg, 1), "graphs": be.stats()["graph_status"]}
    print(f"{name:9s} pp512 {pp:9.1f} tok/s   tg128 {tg:8.1f} tok/s   {res[name]['graphs']}")
    be.close()
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY

if python3 -c "import realizar_backend.cli" 2>/dev/null && python3 -m realizar_backend.cli bench --help >/dev/null 2>&1; then
  for n in smol135 qwen05 gemma270 qwen15; do
    [ -f /tmp/twins/$n.gguf ] && python3 -m realizar_backend.cli bench --model /tmp/twins/$n.gguf --backend cuda 2>&1 | tail -20
  done
fi

python3 - "$OUT" "$rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
s = {"pytest_rc": rc}
try:
    r = ET.parse(f"{out}/junit.xml").getroot()
    ts = r if r.tag == "testsuite" else r.find("testsuite")
    s.update({k: int(ts.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    s["failed"] = [c.get("classname") + "::" + c.get("name") for c in ts.iter("testcase")
                   if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:
    s["junit_error"] = str(e)
try:
    s["bench"] = json.load(open(f"{out}/bench.json"))
except Exception:
    pass
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(s, indent=1))
PY
exit $rc
