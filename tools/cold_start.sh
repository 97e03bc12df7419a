#!/usr/bin/env bash
# Cold start on the GPU machine, as a user sees it: launch to exit of `realizar generate`, and launch
# to /readyz of `bentoml serve`, each a fresh process with an empty CuPy kernel cache.
#   bash tools/cold_start.sh [MODEL.gguf]       (default: the qwen15 twin, /tmp/twins/qwen15.gguf)
# Run it where tools/device_check.sh has set up PYTHONPATH (wheels in /tmp/site) and the twins, e.g.
#   export PYTHONPATH=/tmp/site:$PWD; bash tools/cold_start.sh
# Prints COLD_* lines (seconds) and, from each run's log, where its kernel modules came from.
set -u
MODEL=${1:-/tmp/twins/qwen15.gguf}
PORT=${PORT:-3917}
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$(now)"; }

for run in prebuilt prebuilt2 nvrtc; do
  cache=$(mktemp -d)
  pre=true; [ $run = nvrtc ] && pre=false
  t0=$(now)
  CUPY_CACHE_DIR=$cache REALIZAR_PREBUILT_KERNELS=$pre python3 -m realizar_backend.cli -v generate "Hello" \
    --model "$MODEL" --backend cuda --max-tokens 2 > /tmp/cold_$run.out 2> /tmp/cold_$run.err
  rc=$?
  echo "COLD_GENERATE_${run^^}_S $(since $t0) (exit status $rc, output: $(head -c 80 /tmp/cold_$run.out | tr '\n' ' '))"
  grep -h -o "core ready.*compiled with NVRTC so far" /tmp/cold_$run.err | head -1
  [ $rc = 0 ] || tail -5 /tmp/cold_$run.err
  rm -rf "$cache"
done

for run in prebuilt nvrtc; do
  cache=$(mktemp -d)
  pre=true; [ $run = nvrtc ] && pre=false
  t0=$(now)
  CUPY_CACHE_DIR=$cache REALIZAR_PREBUILT_KERNELS=$pre REALIZAR_MODEL="$MODEL" REALIZAR_BACKEND=cuda \
    BENTOML_DO_NOT_TRACK=true setsid python3 -m bentoml serve realizar_backend.serving.service:Realizar \
    --port "$PORT" > /tmp/cold_serve_$run.log 2>&1 &
  pid=$!
  ok=no
  for _ in $(seq 1 1200); do
    if curl -sf -o /dev/null "127.0.0.1:$PORT/readyz"; then ok=yes; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.05
  done
  echo "COLD_SERVE_READYZ_${run^^}_S $(since $t0) (ready: $ok)"
  grep -h -o "core ready.*compiled with NVRTC so far" /tmp/cold_serve_$run.log | head -1
  [ $ok = yes ] || tail -20 /tmp/cold_serve_$run.log
  kill -TERM -- -$pid 2>/dev/null; sleep 2; kill -KILL -- -$pid 2>/dev/null
  rm -rf "$cache"
done
