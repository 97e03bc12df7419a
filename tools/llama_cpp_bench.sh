#!/usr/bin/env bash
# llama.cpp's figures beside ours, on the GPU machine: builds the kit of tools/llama_cpp_kit.sh
# (.llamacpp/llama.cpp.tar.xz, carried) with CUDA for sm_90 and runs llama-bench and llama-batched-bench
# on a shape twin. Called by tools/device_check.sh's `llamacpp` stage (after its setup has expanded the
# twins into /tmp/twins), or by hand:
#   bash tools/llama_cpp_bench.sh [all|build|bench]        (default all)
# The build lives in $LLAMACPP_WORK (/tmp: it survives while the machine stays warm), so a second call
# skips it; a build cut off by $LLAMACPP_BUILD_TIMEOUT resumes where it stopped on the next call.
# Settings (environment): LLAMACPP_MODEL (/tmp/twins/qwen15.gguf), LLAMACPP_WORK (/tmp/llamacpp),
#   LLAMACPP_TARGETS ("llama-bench llama-batched-bench"; add llama-server for the HTTP figures), LLAMACPP_JOBS (16),
#   LLAMACPP_BUILD_TIMEOUT (seconds, 480), LLAMACPP_DEPTHS ("4096 16384"; empty: none), LLAMACPP_REPS (llama-bench -r, 5),
#   LLAMACPP_NPL ("1,4,16,64"), LLAMACPP_DEPTH_NPL (16), LLAMACPP_PREBUILT (1: use .llamacpp/bin.tar.xz if it fits)
#   LLAMACPP_RESULTS (the benchmarks' raw output, $LLAMACPP_WORK/results: one per run where several share a build)
#   LLAMACPP_KIT (the source kit, .llamacpp/llama.cpp.tar.xz)
# Output: the tables on stdout; $OUT/llamacpp.json (the build, "prebuilt": the pack's bin.VERSION or null,
#   llama-bench's JSON rows, batched-bench's rows,
#   and "summary": llama-bench's median tok/s per test, batched-bench's aggregate decode tok/s S_TG per row)
# Time on the H100 machine (2026-11-24): the build 269 s with -j16 (4,400 CPU-seconds: throughput-bound),
#   llama-server 23 s more, the benchmarks 21 s.
# Prebuilt: where .llamacpp/bin.tar.xz (tools/llama_cpp_prebuild.sh, run on a machine without a GPU) was made
#   from this very kit (bin.VERSION's kit sha256), build unpacks its three programs into $LLAMACPP_WORK/build/bin
#   instead of compiling (a few seconds); they load libcublas.so.13 from the Python nvidia wheels ($WORK/ldpath)
#   and need a driver for CUDA 13. LLAMACPP_PREBUILT=0, a pack of another kit, or programs that do not start
#   here: the cmake build as before.
set -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
MODE=${1:-all}
OUT=${OUT:-$REPO/.device/out}
KIT=${LLAMACPP_KIT:-$REPO/.llamacpp/llama.cpp.tar.xz}
WORK=${LLAMACPP_WORK:-/tmp/llamacpp}
MODEL=${LLAMACPP_MODEL:-/tmp/twins/qwen15.gguf}
TARGETS=${LLAMACPP_TARGETS:-llama-bench llama-batched-bench}
JOBS=${LLAMACPP_JOBS:-16}
BUILD_TIMEOUT=${LLAMACPP_BUILD_TIMEOUT:-480}
DEPTHS=${LLAMACPP_DEPTHS-4096 16384}     # set but empty: none
REPS=${LLAMACPP_REPS:-5}
NPL=${LLAMACPP_NPL:-1,4,16,64}
DEPTH_NPL=${LLAMACPP_DEPTH_NPL:-16}
PREBUILT=${LLAMACPP_PREBUILT:-1}
PACK=$REPO/.llamacpp/bin.tar.xz
BIN=$WORK/build/bin
RES=${LLAMACPP_RESULTS:-$WORK/results}
mkdir -p "$OUT" "$WORK" "$RES"

# ---------------------------------------------------------------- build
# the cuBLAS that the Python wheels bring (nvidia/cu13 or nvidia/cublas): the directory holding include/ and
# lib/ with a library named like $1 (default any libcublas.so*); nothing if none
wheel_cublas() {
  python3 - "${1:-libcublas.so*}" <<'PY'
import glob, os, sys
try:
    import nvidia
except ImportError:
    raise SystemExit
for p in nvidia.__path__:
    for h in sorted(glob.glob(os.path.join(p, "*", "include", "cublas_v2.h")), reverse=True):
        d = os.path.dirname(os.path.dirname(h))
        if glob.glob(os.path.join(d, "lib", sys.argv[1])):
            print(d)
            raise SystemExit
PY
}

# the programs of .llamacpp/bin.tar.xz, when it was made from this kit and they start here
prebuilt() {
  local sha=$1 cublas ldpath msg
  [ "$PREBUILT" != 0 ] && [ -f "$PACK" ] || return 1
  if [ "$(awk '$1 == "kit" {print $2}' "$REPO/.llamacpp/bin.VERSION" 2>/dev/null)" != "$sha" ]; then
    echo "llamacpp: $PACK is of another kit (bin.VERSION): building"; return 1
  fi
  cublas=$(wheel_cublas 'libcublas.so.13')
  if [ -n "$cublas" ]; then ldpath=$cublas/lib
  elif ldconfig -p 2>/dev/null | grep -q 'libcublas\.so\.13 '; then ldpath=
  else echo "llamacpp: no libcublas.so.13 (nvidia wheels, ldconfig) for the prebuilt programs: building"; return 1
  fi
  local psha
  psha=$(sha256sum "$PACK" | cut -c1-16)
  if [ "$(cat "$WORK/prebuilt.sha" 2>/dev/null)" != "$psha" ] || [ ! -x "$BIN/llama-bench" ]; then
    rm -rf "$WORK/build" "$WORK/prebuilt.sha" "$WORK/prebuilt.version" && mkdir -p "$BIN" && tar -xJf "$PACK" -C "$BIN" || return 1
    echo "$psha" > "$WORK/prebuilt.sha"
  fi
  if ! msg=$(LD_LIBRARY_PATH=$ldpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$BIN/llama-bench" --help 2>&1 >/dev/null); then
    echo "llamacpp: the prebuilt llama-bench does not start here: building"; echo "$msg" | tail -5
    rm -rf "$WORK/build" "$WORK/prebuilt.sha" "$WORK/prebuilt.version"; return 1
  fi
  if [ -n "$ldpath" ]; then echo "$ldpath" > "$WORK/ldpath"; else rm -f "$WORK/ldpath"; fi
  echo 0 > "$WORK/build_s"
  cp "$REPO/.llamacpp/bin.VERSION" "$WORK/prebuilt.version"
  echo "llamacpp: prebuilt binaries (built here $(awk '$1 == "built" {print $2}' "$REPO/.llamacpp/bin.VERSION"))," \
       "nvcc $(awk '$1 == "nvcc" {print $2}' "$REPO/.llamacpp/bin.VERSION"), cuBLAS from ${ldpath:-the system}"
}

build() {
  [ -f "$KIT" ] || { echo "llamacpp: no $KIT (run tools/llama_cpp_kit.sh here and carry .llamacpp)"; return 1; }
  local nvcc cmake gen sha t0
  sha=$(sha256sum "$KIT" | cut -c1-16)
  prebuilt "$sha" && return 0
  # the pack's programs are no cmake build
  if [ -f "$WORK/prebuilt.sha" ]; then rm -rf "$WORK/build" "$WORK/prebuilt.sha" "$WORK/prebuilt.version" "$WORK/build_s" "$WORK/ldpath"; fi
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null) || { echo "llamacpp: no nvcc"; return 1; }
  cmake=$(command -v cmake) || { echo "llamacpp: no cmake"; return 1; }
  echo "llamacpp: $("$cmake" --version | head -1), nvcc $("$nvcc" --version | grep -o 'release [0-9.]*'), $(tr '\n' ' ' < "$REPO/.llamacpp/VERSION" 2>/dev/null)"
  if [ "$(cat "$WORK/kit.sha" 2>/dev/null)" != "$sha" ]; then   # a new kit: start over
    rm -rf "$WORK/src" "$WORK/build" "$WORK/build_s" "$WORK/ldpath"
    mkdir -p "$WORK/src" && tar -xJf "$KIT" -C "$WORK/src" || return 1
    echo "$sha" > "$WORK/kit.sha"
  fi
  if [ ! -f "$WORK/build/CMakeCache.txt" ]; then
    local extra=() cublas
    # cuBLAS: the toolkit's, else the one the Python wheels bring (nvidia/cu13 or nvidia/cublas)
    if ! ls "$(dirname "$(dirname "$(readlink -f "$nvcc")")")"/{include,targets/*/include}/cublas_v2.h >/dev/null 2>&1; then
      cublas=$(wheel_cublas)
      [ -n "$cublas" ] || { echo "llamacpp: no cuBLAS (neither in the toolkit nor in the nvidia wheels)"; return 1; }
      # only cuBLAS's own headers: the wheel's include dir may hold other CUDA headers of another version
      mkdir -p "$WORK/cublas/include"
      ln -sf "$cublas"/include/cublas*.h "$cublas"/include/nvblas.h "$WORK/cublas/include/" 2>/dev/null
      extra=(-DCUDA_cublas_LIBRARY="$(ls "$cublas"/lib/libcublas.so* | head -1)"
             -DCUDA_cublasLt_LIBRARY="$(ls "$cublas"/lib/libcublasLt.so* | head -1)"
             -DCMAKE_CUDA_FLAGS="-I$WORK/cublas/include" -DCMAKE_CXX_FLAGS="-I$WORK/cublas/include")
      echo "$cublas/lib" > "$WORK/ldpath"
      echo "llamacpp: cuBLAS from $cublas"
    fi
    # the driver library for ggml's virtual-memory pool: the toolkit's stub, else the driver's own
    if ! ls "$(dirname "$(dirname "$(readlink -f "$nvcc")")")"/{lib64,lib,targets/*/lib}/{,stubs/}libcuda.so >/dev/null 2>&1; then
      local drv
      drv=$( (ldconfig -p 2>/dev/null | grep -o '/.*/libcuda\.so\(\.1\)\?$'; ls /usr/local/nvidia/lib64/libcuda.so* \
              /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null) | head -1)
      if [ -n "$drv" ]; then extra+=(-DCUDA_cuda_driver_LIBRARY="$drv")
      else extra+=(-DGGML_CUDA_NO_VMM=ON); echo "llamacpp: no libcuda found: built without the VMM pool"; fi
    fi
    # the vendored commit into the programs' build info (the kit carries no git metadata)
    extra+=(-DLLAMA_BUILD_COMMIT="$(awk '$1 == "llama.cpp" {print $2}' "$REPO/.llamacpp/VERSION" 2>/dev/null)")
    gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    "$cmake" -S "$WORK/src/llama.cpp" -B "$WORK/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      "${extra[@]}" > "$WORK/configure.log" 2>&1 \
      || { tail -30 "$WORK/configure.log"; rm -f "$WORK/build/CMakeCache.txt"; return 1; }
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$BUILD_TIMEOUT" "$cmake" --build "$WORK/build" -j "$JOBS" --target $TARGETS > "$WORK/build.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  echo $(( $(cat "$WORK/build_s" 2>/dev/null || echo 0) + dt )) > "$WORK/build_s"
  if [ $rc = 124 ]; then
    echo "llamacpp: build not finished in ${BUILD_TIMEOUT} s ($(grep -o '^\[[0-9]*/[0-9]*\]' "$WORK/build.log" | tail -1));" \
         "call again on the warm machine: it resumes"
    return 3
  elif [ $rc != 0 ]; then
    grep -B2 -A12 -m3 "error" "$WORK/build.log" | head -60; return 1
  fi
  echo "llamacpp: built $TARGETS (this call ${dt} s, in all $(cat "$WORK/build_s") s)"
}

# ---------------------------------------------------------------- benchmarks
lbench() {  # name args...: llama-bench, JSON rows kept, the markdown table shown
  local n=$1; shift
  timeout 300 "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -r "$REPS" "$@" -o json -oe md \
    > "$RES/lb_$n.json" 2> "$RES/lb_$n.err"
  local rc=$?
  grep '^|' "$RES/lb_$n.err"
  [ $rc = 0 ] || { echo "llama-bench $n failed (rc $rc):"; grep -v '^|' "$RES/lb_$n.err" | tail -15; }
}
bbench() {  # name ctx args...: llama-batched-bench, JSON lines kept, shown as a table
  local n=$1 c=$2; shift 2
  timeout 300 "$BIN/llama-batched-bench" -m "$MODEL" -ngl 99 -fa on -c "$c" "$@" --output-format jsonl \
    > "$RES/bb_$n.log" 2>&1
  local rc=$?
  grep '^{"n_kv_max"' "$RES/bb_$n.log" > "$RES/bb_$n.jsonl"
  python3 - "$RES/bb_$n.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| batched-bench | PP | TG | B | N_KV | S_PP t/s | S_TG t/s | S t/s |")
for r in rows:
    print(f"| | {r['pp']} | {r['tg']} | {r['pl']} | {r['n_kv']} | {r['speed_pp']:.0f} | {r['speed_tg']:.1f} | {r['speed']:.1f} |")
PY
  [ $rc = 0 ] || { echo "llama-batched-bench $n failed (rc $rc):"; tail -15 "$RES/bb_$n.log"; }
}
bench() {
  [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ] || { echo "llamacpp: not built"; return 1; }
  [ -f "$MODEL" ] || { echo "llamacpp: no model $MODEL"; return 1; }
  rm -f "$RES"/*
  [ -f "$WORK/ldpath" ] && export LD_LIBRARY_PATH=$(cat "$WORK/ldpath")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  local t0 dl
  t0=$(date +%s)
  echo "== llama.cpp on $(basename "$MODEL"): llama-bench -ngl 99 -fa 1 -r $REPS"
  lbench short -p 512 -n 128
  dl=$(echo $DEPTHS | tr ' ' ',')
  if [ -n "$dl" ]; then
    lbench prefill -p "$dl" -n 0
    lbench depth -p 0 -n 128 -d "$dl"
  fi
  echo "== llama-batched-bench -ngl 99 -fa on (128-token prompts, 128 new tokens per sequence)"
  local maxpl
  maxpl=$(echo "$NPL" | tr ',' '\n' | sort -n | tail -1)
  bbench streams $(( maxpl * 256 + 4096 )) -npp 128 -ntg 128 -npl "$NPL"
  for d in $DEPTHS; do
    [ "$d" = 4096 ] || continue      # the issue's row: 16 sequences of 4,096 tokens
    bbench depth$d $(( DEPTH_NPL * (d + 128) + 4096 )) -npp "$d" -ntg 128 -npl "$DEPTH_NPL"
  done
  echo "llamacpp: benchmarks took $(( $(date +%s) - t0 )) s"
}

# ---------------------------------------------------------------- report
report() {
  python3 - "$RES" "$OUT/llamacpp.json" "$WORK" "$REPO/.llamacpp/VERSION" "$MODEL" <<'PY'
import glob, json, os, statistics, sys
res, out, work, ver, model = sys.argv[1:]
def read(p, default=""):
    try:
        return open(p).read().strip()
    except OSError:
        return default
r = {"version": read(ver), "model": model, "build_s": int(read(f"{work}/build_s", "0") or 0),
     "prebuilt": read(f"{work}/prebuilt.version") or None,
     "llama_bench": [], "batched_bench": [], "summary": {}}
for f in sorted(glob.glob(f"{res}/lb_*.json")):
    try:
        rows = json.load(open(f))
    except Exception as e:
        r["llama_bench"].append({"file": os.path.basename(f), "error": str(e)})
        continue
    for x in rows:
        key = (f"pp{x['n_prompt']}" if x["n_prompt"] else f"tg{x['n_gen']}") + (f"@d{x['n_depth']}" if x.get("n_depth") else "")
        # the median: a process's first test can start cold (pp512 ran 18.5k then 30k, 30k... once)
        r["summary"][key] = round(statistics.median(x.get("samples_ts") or [x["avg_ts"]]), 1)
        r["llama_bench"].append(x)
for f in sorted(glob.glob(f"{res}/bb_*.jsonl")):
    for l in open(f):
        x = json.loads(l)
        r["batched_bench"].append(x)
        r["summary"][f"batched_pp{x['pp']}_tg{x['tg']}_b{x['pl']}"] = round(x["speed_tg"], 1)
json.dump(r, open(out, "w"), indent=1)
print("LLAMACPP_SUMMARY " + json.dumps(r["summary"]))
PY
}

rc=0
case $MODE in
  build) build; rc=$? ;;
  bench) bench; rc=$? ;;
  all) build && bench; rc=$? ;;
  *) echo "usage: $0 [all|build|bench]"; exit 2 ;;
esac
report
exit $rc
