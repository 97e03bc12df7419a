#!/usr/bin/env bash
# Cold start on the GPU machine, as a user sees it: launch to exit of `realizar generate`, and launch
# to /readyz of `bentoml serve`, each a fresh process with an empty CuPy kernel cache. Each runs twice
# with the prebuilt kernels: the first run of a fresh machine also reads from disk the Python files no
# process had read yet (BentoML's worker side, for the first server), the second shows the spread.
#   bash tools/cold_start.sh [MODEL.gguf]       (default: the qwen15 twin, /tmp/twins/qwen15.gguf)
# (BACKEND=cpu runs the same steps on the CPU backend: a check of this script without a GPU)
# Run it where tools/device_check.sh has set up PYTHONPATH (wheels in /tmp/site) and the twins, e.g.
#   export PYTHONPATH=/tmp/site:$PWD; bash tools/cold_start.sh
# Prints COLD_* lines (seconds) and, from each run's log, where its kernel modules came from; for
# the prebuilt runs also the start-up timeline (realizar_backend/timeline.py: seconds since that
# process started, and the wall clock, to line up with the launch time printed beside it), and how
# many kernels CuPy compiled into the empty cache (its own kernels, or ours through NVRTC).
# IMPORTTIME=1 adds one more `bentoml serve` start under PYTHONPROFILEIMPORTTIME (not timed) and
# prints the imports that cost its worker most before our service module.
set -u
MODEL=${1:-/tmp/twins/qwen15.gguf}
PORT=${PORT:-3917}
BACKEND=${BACKEND:-cuda}
now() { date +%s.%N; }
clock() { date +%H:%M:%S.%3N; }
timeline() { echo "  timeline of $1 (launched at $2):"; sed -n 's/.*startup \([0-9.]* s (.*\)/    \1/p' "$1"; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$(now)"; }
cached() { echo "  CuPy kernel cache after the run: $(find "$1" -type f | wc -l) files $(find "$1" -type f -printf '%f ' | head -c 300)"; }

for run in prebuilt prebuilt2 nvrtc; do
  cache=$(mktemp -d)
  pre=true; [ $run = nvrtc ] && pre=false
  t0=$(now); c0=$(clock)
  CUPY_CACHE_DIR=$cache REALIZAR_PREBUILT_KERNELS=$pre python3 -m realizar_backend.cli -v generate "Hello" \
    --model "$MODEL" --backend "$BACKEND" --max-tokens 2 > /tmp/cold_$run.out 2> /tmp/cold_$run.err
  rc=$?
  echo "COLD_GENERATE_${run^^}_S $(since $t0) (exit status $rc, output: $(head -c 80 /tmp/cold_$run.out | tr '\n' ' '))"
  grep -h -o "core ready.*compiled with NVRTC so far" /tmp/cold_$run.err | head -1
  [ $run = prebuilt ] && timeline /tmp/cold_$run.err "$c0"
  [ $run = nvrtc ] || cached "$cache"
  [ $rc = 0 ] || tail -5 /tmp/cold_$run.err
  rm -rf "$cache"
done

for run in prebuilt prebuilt2 nvrtc; do
  cache=$(mktemp -d)
  pre=true; [ $run = nvrtc ] && pre=false
  t0=$(now); c0=$(clock)
  CUPY_CACHE_DIR=$cache REALIZAR_PREBUILT_KERNELS=$pre REALIZAR_MODEL="$MODEL" REALIZAR_BACKEND=$BACKEND \
    BENTOML_DO_NOT_TRACK=true setsid python3 -m bentoml serve realizar_backend.serving.service:Realizar \
    --port "$PORT" > /tmp/cold_serve_$run.log 2>&1 &
  pid=$!
  ok=no
  for _ in $(seq 1 1200); do
    if curl -sf -o /dev/null "127.0.0.1:$PORT/readyz"; then ok="yes at $(clock)"; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.05
  done
  echo "COLD_SERVE_READYZ_${run^^}_S $(since $t0) (ready: $ok)"
  grep -h -o "core ready.*compiled with NVRTC so far" /tmp/cold_serve_$run.log | head -1
  [ $run != nvrtc ] && timeline /tmp/cold_serve_$run.log "$c0" && cached "$cache"
  [ "$ok" != no ] || tail -20 /tmp/cold_serve_$run.log
  kill -TERM -- -$pid 2>/dev/null; sleep 2; kill -KILL -- -$pid 2>/dev/null
  rm -rf "$cache"
done

if [ "${IMPORTTIME:-0}" = 1 ]; then
  cache=$(mktemp -d)
  CUPY_CACHE_DIR=$cache REALIZAR_MODEL="$MODEL" REALIZAR_BACKEND=$BACKEND BENTOML_DO_NOT_TRACK=true PYTHONPROFILEIMPORTTIME=1 \
    setsid python3 -m bentoml serve realizar_backend.serving.service:Realizar --port "$PORT" > /tmp/cold_serve_imports.log 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do curl -sf -o /dev/null "127.0.0.1:$PORT/readyz" && break; kill -0 $pid 2>/dev/null || break; sleep 0.05; done
  kill -TERM -- -$pid 2>/dev/null; sleep 2; kill -KILL -- -$pid 2>/dev/null
  rm -rf "$cache"
  # the worker's lines: from the serving process's "Starting production" line to our module's first mark
  echo "  imports of the serving worker before our service module (cumulative ms, top level, largest 15):"
  awk '/Starting production/ {w = 1} w && /GPUs visible/ && /\[:1\]/ {exit}
       w && /^import time:/ {split($0, a, "|"); n = a[3]; sub(/^ /, "", n); if (n !~ /^ /) printf "%8.1f  %s\n", a[2] / 1000, n}' \
    /tmp/cold_serve_imports.log | sort -rn | head -15
fi
