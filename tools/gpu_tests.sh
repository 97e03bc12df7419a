#!/usr/bin/env bash
# The GPU test files, one pytest process each (`pytest -m gpu FILE`): one after another, or on a machine
# of several GPUs one queue a GPU. tools/device_check.sh's tests stage runs it; so can a device call.
#   bash tools/gpu_tests.sh FILE...       (OUT: where pytest.log and junit.xml go; exit 1 on any failure)
# Environment: TESTS_DEADLINE (s from the start at which each file is stopped, default 560: one call's
# limit), GPU_QUEUES (default: every GPU nvidia-smi lists; 1: one after another on the visible GPUs),
# GPU_ALL_FILES (file names run after the queues, seeing every GPU), PYTEST_ARGS, GPU_TESTS_WORK (the
# per-file logs, default /tmp/gpu_tests).
set -o pipefail
OUT=${OUT:-.device/out}; W=${GPU_TESTS_WORK:-/tmp/gpu_tests}
t0=$(date +%s); rm -rf "$W"; mkdir -p "$W" "$OUT"; : > "$OUT/pytest.log"; rc=0
# one pytest process a file, each stopped at the stage's deadline; its outcome in $W/NAME.*
test_file() {  # file [gpu]
  local f=$1 n left s0 r; n=$(basename "$1" .py); left=$(( ${TESTS_DEADLINE:-560} - $(date +%s) + t0 ))
  [ $left -lt 20 ] && { echo 1 > "$W/$n.rc"; echo "$n: not run (the stage's deadline)" > "$W/$n.sum"; return; }
  s0=$(date +%s)
  ${2:+env CUDA_VISIBLE_DEVICES=$2 OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads} \
    timeout $left python3 -m pytest -m gpu "$f" -p no:cacheprovider -rfE -q --durations=5 \
    --junitxml="$W/$n.xml" ${PYTEST_ARGS:-} > "$W/$n.log" 2>&1
  r=$?; echo $r > "$W/$n.rc"
  { echo "$n rc=$r $(( $(date +%s) - s0 )) s${2:+ (GPU $2)}: $(tail -1 "$W/$n.log")"
    grep -E "^(FAILED|ERROR)" "$W/$n.log" | head -10; } > "$W/$n.sum"
}
files=("$@")
# On a machine of several GPUs, one queue a GPU ($GPU_QUEUES, default every GPU; 1: one after another
# on the visible GPUs): each takes the next file, the slowest first (SLOW_FILES, by their times on an
# H100, then the rest largest first). The files of $GPU_ALL_FILES (those that place engines on several
# GPUs) run after the queues, seeing every GPU.
SLOW_FILES="test_long_context.py test_kernels.py test_sampling_gpu.py test_batched_decode.py test_mmq.py
            test_flash_attention.py test_model_parity.py test_prefill_split.py test_kernels_f32.py"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); queues=${GPU_QUEUES:-$ngpu}; [ "${queues:-0}" -ge 1 ] || queues=1
# the queues share the CPU: each file's BLAS threads (the NumPy oracles) get its share of the cores, since
# every process spinning a thread per core would thrash them
threads=$(( $(nproc) / queues )); [ $threads -ge 1 ] || threads=1
all_gpus=() queued=()
for f in "${files[@]}"; do
  if [ "$queues" -gt 1 ] && [[ " ${GPU_ALL_FILES-test_engines_gpu.py} " == *" $(basename "$f") "* ]]; then all_gpus+=("$f"); else queued+=("$f"); fi
done
if [ "$queues" -gt 1 ]; then
  { for n in $SLOW_FILES; do printf '%s\n' "${queued[@]}" | grep "/$n\$"; done
    [ ${#queued[@]} -gt 0 ] && ls -S "${queued[@]}" 2>/dev/null | grep -v -F "$(printf '%s\n' $SLOW_FILES)"; } > "$W/queue"
  next() { flock "$W/queue.lock" sh -c 'head -1 "$1/queue"; sed -i 1d "$1/queue"' sh "$W"; }
  # each file's line as it ends (a call cut off still returns them); `wait` on the workers' pids: a
  # bare `wait` would also wait on the log's tee (bash 5.1+ waits on the last process substitution)
  workers=()
  for ((g = 0; g < queues; g++)); do
    ( while f=$(next) && [ -n "$f" ]; do test_file "$f" $g; cat "$W/$(basename "$f" .py).sum"; done ) &
    workers+=($!)
  done
  wait "${workers[@]}"
else
  for f in "${queued[@]}"; do test_file "$f"; cat "$W/$(basename "$f" .py).sum"; done
fi
for f in "${all_gpus[@]}"; do test_file "$f"; cat "$W/$(basename "$f" .py).sum"; done
for f in "${files[@]}"; do
  n=$(basename "$f" .py); r=$(cat "$W/$n.rc" 2>/dev/null || echo 1)
  [ "$r" -ne 0 ] && [ "$r" -ne 5 ] && rc=1
  { echo "==== $f (rc=$r)"; cat "$W/$n.log" 2>/dev/null; } >> "$OUT/pytest.log"
done
echo "pytest rc=$rc in $(( $(date +%s) - t0 )) s"
# the files' reports as one junit.xml (one testsuite: their cases and summed counts)
python3 - "$OUT/junit.xml" $W/*.xml <<'PY'
import sys, xml.etree.ElementTree as ET
merged = ET.Element("testsuite", name="pytest -m gpu")
counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
for f in sys.argv[2:]:
  root = ET.parse(f).getroot()
  for ts in ([root] if root.tag == "testsuite" else root.findall("testsuite")):
      for k in counts:
          counts[k] += int(ts.get(k, 0))
      merged.extend(ts.findall("testcase"))
for k, v in counts.items():
  merged.set(k, str(v))
ET.ElementTree(merged).write(sys.argv[1])
PY
exit $rc
