#!/usr/bin/env bash
# THE device script: everything the GPU machine checks, in one call, with a report under $OUT.
#   1. installs the carried wheels (.whl/, from /work/shared/tools/device_wheels.sh) into /tmp/site
#   2. expands the shape twins (.twins/NAME.head.gz (gzip: the heads are mostly vocabulary) +
#      NAME.json + twin_expand.py) into /tmp/twins
#   3. assembles the real SmolLM2 from parts carried in earlier calls (.device/smol.part*,
#      staged in /tmp/stage while the machine stays warm); `device_check.sh stage` only stages
#   4. runs `pytest -m gpu` (no -x: the full report), then `realizar bench` (pp512, tg128, 5 reps)
#      on each twin and the per-kernel decode profile of qwen15
# Output (8 files at most: a call returns no more): $OUT/log (everything), $OUT/junit.xml, $OUT/pytest.log,
#         $OUT/bench.json (every twin's `realizar bench --json`), $OUT/profile_qwen15.json, $OUT/summary.json
# Env: PYTEST_ARGS (extra pytest arguments), PYTEST_PATHS (default tests/gpu), BENCH_TWINS / PROFILE_TWINS (which twins), SKIP_TESTS=1,
#      SWEEP=1 (tools/mmvf_sweep.py first, $OUT/sweep.json), QUICK=1 (no ncu, no precision variants),
#      PROBE=1 (tools/start_probe.py before the cold starts)
set -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/.device/out}
mkdir -p "$OUT" /tmp/stage /tmp/twins /tmp/bench; rm -f /tmp/bench/*.json
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
# bytecode, as `pip install` leaves it (the cold start below would otherwise time Python compiling sources)
python3 -m compileall -q -j 0 /tmp/site "$REPO/realizar_backend" >/dev/null 2>&1 || true

# 2. twins
export REALIZAR_TWINS=/tmp/twins
for n in smol135 qwen05 gemma270 qwen15; do
  if [ -f .twins/$n.head.gz ] && [ ! -f /tmp/twins/$n.gguf ]; then
    gunzip -c .twins/$n.head.gz > /tmp/twins/$n.head && cp .twins/$n.json /tmp/twins/
    python3 .twins/twin_expand.py /tmp/twins/$n /tmp/twins/$n.gguf || echo "twin $n failed"
  fi
done
[ -f "$SMOL" ] && export REALIZAR_REAL_SMOL=$SMOL

# cold start: a fresh process with an empty CuPy kernel cache (as a new container) to its first
# token on the qwen15 twin, twice (the first is also the machine's first CuPy import: its spread),
# then the same with the cache filled (a restart)
if [ -f /tmp/twins/qwen15.gguf ]; then
  # where the time before the first kernel build goes (each in a fresh process, empty kernel
  # cache), when asked: PROBE=1
  for mode in ${PROBE:+phases nvrtc overlap}; do
    echo "-- start probe: $mode"
    T0=$(date +%s.%N) CUPY_CACHE_DIR=$(mktemp -d) python3 tools/start_probe.py $mode /tmp/twins/qwen15.gguf 2>&1 | tail -25
  done
  for run in cold cold2 warm; do
    [ "$run" != warm ] && cold=$(mktemp -d)
    # time from the shell's launch of python to the first token (prefill) and the second (first
    # decode step: graph capture), measured in the process; os._exit skips joining compile threads
    T0=$(date +%s.%N) CUPY_CACHE_DIR=$cold python3 - "$run" > /tmp/start_$run.out 2>/tmp/start_$run.err <<'PY' || { echo "start ($run) failed"; tail -5 /tmp/start_$run.err; }
import logging, os, sys, time
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d ms %(name)s: %(message)s")
logging.getLogger("realizar_backend").setLevel(logging.DEBUG)
import cupy
from realizar_backend.engine.engine import Engine
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.settings import Settings
t0 = float(os.environ["T0"])
t_import = time.time() - t0
eng = Engine.from_settings(Settings(model="/tmp/twins/qwen15.gguf", backend="cuda", max_num_seqs=4, context_length=1024))
g = eng.generate_sync(list(range(100, 140)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
next(g)
t1 = time.time() - t0
list(g)
print(f"START_TO_FIRST_TOKEN_{sys.argv[1].upper()}_S {t1:.2f} (second token {time.time() - t0:.2f},"
      f" imports done {t_import:.2f})", flush=True)
os._exit(0)
PY
    cat /tmp/start_$run.out
    grep -E "^[0-9]+ ms realizar" /tmp/start_$run.err | head -40
  done
  python3 tools/ttft_probe.py /tmp/twins/qwen15.gguf 2>&1 | grep '^\[' || echo "ttft probe failed"
fi

# kernel launch-shape sweep (tools/mmvf_sweep.py), when asked: SWEEP=1
[ -n "${SWEEP:-}" ] && { python3 tools/mmvf_sweep.py --json "$OUT/sweep.json" || echo "sweep failed"; }

# 4. tests
t0=$(date +%s)
[ -n "${SKIP_TESTS:-}" ] && PYTEST_ARGS="$PYTEST_ARGS --co"
python3 -m pytest -m gpu ${PYTEST_PATHS:-tests/gpu} -p no:cacheprovider -rA -q -s --durations=15 \
  --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
rc=$?
echo "pytest rc=$rc in $(( $(date +%s) - t0 )) s"

# timing: `realizar bench` on every twin (the numbers that count), then the per-kernel profile
# of one decode step of qwen15 (time and GB/s per kernel, graph replay per token)
for n in ${BENCH_TWINS:-smol135 qwen05 gemma270 qwen15}; do
  [ -f /tmp/twins/$n.gguf ] || continue
  python3 -m realizar_backend.cli bench --model /tmp/twins/$n.gguf --backend cuda --prompt-tokens 512 \
    --gen-tokens 128 --repetitions 5 --json "/tmp/bench/bench_$n.json" 2>&1 | grep -v '^{' || echo "bench $n failed"
done
for n in ${PROFILE_TWINS:-qwen15}; do
  [ -f /tmp/twins/$n.gguf ] && python3 -m realizar_backend.backends.cuda.profile /tmp/twins/$n.gguf \
    --json "$OUT/profile_$n.json" || echo "profile $n failed"
done
# exact per-kernel times and DRAM bytes of one eager qwen15 decode step (Nsight Compute, clocks as found)
if [ -z "${QUICK:-}" ] && [ -f /tmp/twins/qwen15.gguf ] && command -v ncu >/dev/null; then
  timeout 240 ncu --clock-control none --csv --print-units base \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    python3 -m realizar_backend.backends.cuda.profile /tmp/twins/qwen15.gguf --ncu > "$OUT/ncu_qwen15.csv" 2>/dev/null \
    || echo "ncu failed or timed out"
  python3 tools/ncu_table.py "$OUT/ncu_qwen15.csv" || true
fi

# the precision settings' price: decode and prefill speed of each non-default setting
for v in "int8 fp16" "int8-fp32-down fp16" "fp32 fp16"; do
  [ -n "${QUICK:-}" ] && break
  set -- $v
  for n in ${VARIANT_TWINS:-qwen15 smol135}; do
    [ -f /tmp/twins/$n.gguf ] || continue
    REALIZAR_DECODE_ACTIVATIONS=$1 REALIZAR_PREFILL_PRECISION=$2 python3 -m realizar_backend.cli bench \
      --model /tmp/twins/$n.gguf --backend cuda --prompt-tokens 512 --gen-tokens 128 --repetitions 3 \
      --json "/tmp/bench/variant_${n}_$1_$2.json" 2>&1 | grep '^| .*cuda' | sed "s/^/[$1 \/ $2] /"
  done
done

# the engine and the service on the GPU: `realizar generate` and a real `bentoml serve` give the
# CPU backend's greedy text on the real SmolLM2; streaming speed through the service (qwen15 twin)
serve_up() {  # model port: start bentoml serve on the GPU in the background, wait for /readyz
  REALIZAR_MODEL=$1 REALIZAR_MODEL_NAME=$(basename $1 .gguf) REALIZAR_BACKEND=cuda REALIZAR_MAX_NUM_SEQS=4 REALIZAR_CONTEXT_LENGTH=1024 \
    setsid python3 -m bentoml serve service:Realizar --host 127.0.0.1 --port $2 > "/tmp/serve_$2.log" 2>&1 &
  for i in $(seq 1 120); do curl -sf 127.0.0.1:$2/readyz >/dev/null && return 0; sleep 0.5; done
  echo "server on port $2 never became ready"; tail -20 "/tmp/serve_$2.log"; return 1
}
serve_down() { pkill -f "port $1" ; sleep 1; }
pkill -f "bentoml serve" 2>/dev/null && sleep 2   # servers left by an earlier call on a warm machine
gen() { python3 -m realizar_backend.cli generate "$@" --max-tokens 32 2>>/tmp/generate.err; }
if [ -f "$SMOL" ] && python3 -c "import bentoml" 2>/dev/null; then
  gen "The capital of France is" --model $SMOL --backend cpu > /tmp/g_cpu.txt
  gen "The capital of France is" --model $SMOL --backend cuda > /tmp/g_cuda.txt
  gen "What is the capital of France?" --chat --model $SMOL --backend cpu > /tmp/c_cpu.txt
  echo "generate cpu : $(head -c 200 /tmp/g_cpu.txt | tr '\n' ' ')"
  echo "generate cuda: $(head -c 200 /tmp/g_cuda.txt | tr '\n' ' ')"
  cmp -s /tmp/g_cpu.txt /tmp/g_cuda.txt && echo "GENERATE_GPU_EQUALS_CPU yes" || echo "GENERATE_GPU_EQUALS_CPU no"
  if serve_up $SMOL 3901; then
    curl -s 127.0.0.1:3901/v1/chat/completions -H 'content-type: application/json' -d '{"model": "smol135",
      "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}' \
      > /tmp/serve_chat.json
    python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['choices'][0]['message']['content'])" \
      /tmp/serve_chat.json > /tmp/c_srv.txt
    echo "service chat (cuda): $(head -c 200 /tmp/c_srv.txt | tr '\n' ' ')"
    echo "generate chat (cpu): $(head -c 200 /tmp/c_cpu.txt | tr '\n' ' ')"
    cmp -s /tmp/c_cpu.txt /tmp/c_srv.txt && echo "SERVICE_GPU_EQUALS_CPU yes" || echo "SERVICE_GPU_EQUALS_CPU no"
    curl -s 127.0.0.1:3901/metrics | grep -E '^realizar_(graph_status|generation_tokens_total|gpu_memory)' | head -8
    serve_down 3901
  fi
  if [ -f /tmp/twins/qwen15.gguf ] && serve_up /tmp/twins/qwen15.gguf 3902; then
    grep -h "ready: serving" /tmp/serve_3902.log | tail -1
    python3 tools/serve_bench.py --url http://127.0.0.1:3902 --prompt-tokens 128 --gen-tokens 128 \
      --repetitions 5 --json /tmp/serve_bench_qwen15.json | grep -v '^{'
    serve_down 3902
  fi
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
s["bench"], full = {}, {}
for n in ("smol135", "qwen05", "gemma270", "qwen15"):
    try:
        r = json.load(open(f"/tmp/bench/bench_{n}.json"))
        full[n] = r
        s["bench"][n] = {"pp512_tok_s": round(r["pp_tok_s"]["median"], 1), "tg128_tok_s": round(r["tg_tok_s"]["median"], 1),
                         "load_s": round(r["load_s"], 2), "graphs": r["graph_status"]}
    except Exception:
        pass
import glob, os
for f in sorted(glob.glob("/tmp/bench/variant_*.json")):
    r = json.load(open(f))
    s.setdefault("variants", {})[os.path.basename(f)[8:-5]] = {
        "pp512_tok_s": round(r["pp_tok_s"]["median"], 1), "tg128_tok_s": round(r["tg_tok_s"]["median"], 1)}
    full[os.path.basename(f)[:-5]] = r
try:
    s["serve_bench_qwen15"] = {k: v for k, v in json.load(open("/tmp/serve_bench_qwen15.json")).items() if k != "runs"}
except Exception:
    pass
json.dump(full, open(f"{out}/bench.json", "w"), indent=1)
try:
    p = json.load(open(f"{out}/profile_qwen15.json"))
    s["profile_qwen15"] = {"graph_replay_us_per_token": round(p["graph_replay_us_per_token"], 1),
                           "kernels": {k: [round(v["us_per_step"], 1), round(v["gb_per_s"] or 0)] for k, v in p["kernels"].items()}}
except Exception:
    pass
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(s, indent=1))
PY
exit $rc
