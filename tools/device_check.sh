#!/usr/bin/env bash
# THE device script: everything the GPU machine checks, in one call, with a report under $OUT.
#   bash tools/device_check.sh              every stage
#   STAGES="tests bench" bash tools/device_check.sh    some of them (setup always runs first)
#   STAGES= bash tools/device_check.sh                setup only (wheels, twins, kernels), e.g. before a benchmark
# Stages:
#   setup    carried wheels (.whl*/, from /work/shared/tools/device_wheels.sh) into /tmp/site; the shape twins
#            named in $TWINS (default smol135 qwen05 gemma270 qwen15; .twins/NAME.head.gz + NAME.json,
#            expanded by tools/make_quant_twins.py: every block type) into /tmp/twins; the real SmolLM2 from its
#            parts (.device/smol.part*, a few a call, staged in /tmp/stage while the machine stays warm); the prebuilt
#            kernels rebuilt with this machine's nvcc (tools/build_kernels.py: a no-op when current) and
#            returned as $OUT/cubin.tar.xz when they changed
#   tests    pytest -m gpu over $PYTEST_PATHS (default: every tests/gpu file), no -x: the full report; one
#            pytest process per file (one process for the whole suite ran about twice as slow), each
#            stopped at $TESTS_DEADLINE s from the stage's start (default 560: one call's limit); on
#            several GPUs one queue of files a GPU (tools/gpu_tests.sh: $GPU_QUEUES, $GPU_ALL_FILES).
#            Give the call a limit above TESTS_DEADLINE: a call cut off returns only what is in $OUT
#   kbench   the kernel benchmarks ($KBENCH, default both): benchmarks/mmq_bench.py ($MMQ_BENCH_ARGS),
#            benchmarks/attn_bench.py
#   bench    `realizar bench` on each twin of $BENCH_TWINS (pp512, tg128) and on each of $BATCH_TWINS
#            (default qwen15) at every batch of $BATCHES (128-token prompts, 128 new tokens each), at depth
#            ($DEPTHS: prefill and decode at that depth) and batches at depth ($DEPTH_BATCHES, BATCH:DEPTH)
#            and, with $CONSTRAINED_BATCHES, held to a JSON schema on every row and on every other
#            row (`--constrained all|half`: plain, sampled-path and constrained tok/s)
#   vllm     vLLM beside us (tools/vllm_serve_bench.sh: the shared vLLM kit's parts carried into /tmp/vllm_chunks
#            by calls of their own): `vllm serve` on /tmp/vllm_models/$LT_TWIN (bf16 random weights) and `vllm bench
#            serve` at $VLLM_CONCURRENCY (default 64) on the serve stage's loadtest shape; $OUT/vllm.json.
#            Before the serve stage in the same call: one GPU at a time
#   serve    the real SmolLM2: `realizar generate` and `bentoml serve` on the GPU give the CPU backend's
#            greedy text; then `realizar loadtest` through `bentoml serve` on the $LT_TWIN twin (default qwen15) at
#            $LT_CLIENTS clients (LT_WARMUP=1: after two unmeasured runs of the same size), a soak with random cancels
#            ($SOAK_REQUESTS completions), and $LT_VARIANTS (server settings, one fresh server each)
#   cold     tools/cold_start.sh: launch-to-exit of `realizar generate`, launch-to-/readyz of `bentoml serve`
#   llamacpp llama.cpp beside us on a twin (tools/llama_cpp_bench.sh; carry .llamacpp, made by
#            tools/llama_cpp_kit.sh): builds it for sm_90 in /tmp/llamacpp (skipped on a warm machine that has
#            it; a build cut off by the call's limit resumes on the next call; ~270 s), or unpacks the programs
#            that tools/llama_cpp_prebuild.sh built from the same kit elsewhere (.llamacpp/bin.tar.xz, carried
#            with the kit), then llama-bench (pp512, tg128,
#            prefill and decode at $LLAMACPP_DEPTHS) and llama-batched-bench (1..64 streams; 16 at depth 4,096);
#            with $LLAMACPP_LT_CLIENTS, `realizar loadtest` through llama-server at those client counts; all
#            of it on $LLAMACPP_MODEL (default /tmp/twins/qwen15.gguf)
#   peers    each twin of $PEER_TWINS beside llama.cpp, one queue of twins a GPU (tools/peers.sh: expanded,
#            `realizar bench` pp512 + tg128 and 16 and 64 streams, llama-bench and llama-batched-bench, deleted;
#            carry .llamacpp and the twins' heads): a line per twin, $OUT/peers.json
#   workers  one engine per GPU: `realizar loadtest` at $LT_CLIENTS clients per GPU (8 requests each, seed 3,
#            after two warm-up runs of seeds 1 and 2) through `bentoml serve` on the $LT_TWIN twin with
#            REALIZAR_WORKERS=N for each N of $WORKER_COUNTS (default "1 2"; "1 2 4" on four GPUs); an entry
#            N:F also sets REALIZAR_FRONT_ENDS=F (else the rule: one front end per engine), e.g.
#            WORKER_COUNTS="1 4:1 4:2"; /metrics and nvidia-smi's processes of each; the speed-up of generation
#            tok/s (N vs 1), the front ends' count and CPU (all of them, in cores), the errors and each
#            engine's requests in serve.json ("workers", keys workersN or workersN_feF) and the log
# `device_check.sh stage` only stages (for the calls that carry the SmolLM2 parts before the last).
# Output: $OUT/log (everything), $OUT/junit.xml, $OUT/pytest.log, $OUT/bench.json, $OUT/kbench.json,
#         $OUT/serve.json, $OUT/summary.json, $OUT/cubin.tar.xz, $OUT/llamacpp.json (llama.cpp's figures are
#         also in summary.json, under "llamacpp"), $OUT/peers.json, $OUT/vllm.json
set -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/.device/out}
STAGES=${STAGES-tests kbench bench serve cold}   # unset: these; set but empty: setup only
BATCHES=${BATCHES:-1 4 16 64 128 256}
DEPTHS=${DEPTHS:-}
CONSTRAINED_BATCHES=${CONSTRAINED_BATCHES:-}
LT_CLIENTS=${LT_CLIENTS:-64}
LT_MODEL=/tmp/twins/${LT_TWIN:-qwen15}.gguf   # the serve and workers stages' loadtest model
SOAK_REQUESTS=${SOAK_REQUESTS:-0}
mkdir -p "$OUT" /tmp/stage /tmp/twins /tmp/bench; rm -f /tmp/bench/*.json
export PYTHONUNBUFFERED=1 BENTOML_DO_NOT_TRACK=true
exec > >(tee -a "$OUT/log") 2>&1
cd "$REPO"
has() { [[ " $STAGES " == *" $1 "* ]]; }

echo "== $(date -u +%FT%TZ) device_check ${1:-} stages: $STAGES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# ---------------------------------------------------------------- setup
for p in .device/smol.part*; do [ -f "$p" ] && cp -f "$p" /tmp/stage/ && echo "staged $p"; done
SMOL=/tmp/smol135.gguf
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# the parts in name order (split -n 6 -d: smol.part00..05 of 16.4 MB, two or three a call beside the wheels or
# the tiny test models; staged in /tmp/stage while the machine stays warm); whole once they match
if [ ! -f "$SMOL" ] && ls /tmp/stage/smol.part* >/dev/null 2>&1; then
  cat $(ls /tmp/stage/smol.part* | sort) > "$SMOL.tmp"
  if [ "$(sha256sum "$SMOL.tmp" | cut -d' ' -f1)" = "$SMOL_SHA" ]; then mv "$SMOL.tmp" "$SMOL"; echo "real SmolLM2 assembled"
  else echo "real SmolLM2: $(ls /tmp/stage/smol.part* | wc -l) parts staged, not yet whole"; rm -f "$SMOL.tmp"; fi
fi
for d in .whl*; do   # once per set of wheels on a warm machine (a reinstall would pull files from under running jobs)
  ls "$d"/*.whl >/dev/null 2>&1 || continue
  mark=/tmp/site/.installed-$(ls "$d" | md5sum | cut -c1-16); [ -f "$mark" ] && continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
    || { echo "wheel install from $d failed"; exit 1; }
  touch "$mark"
done
export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
for n in ${TWINS:-smol135 qwen05 gemma270 qwen15}; do
  if [ -f .twins/$n.head.gz ] && [ ! -f /tmp/twins/$n.gguf ]; then
    gunzip -c .twins/$n.head.gz > /tmp/twins/$n.head && cp .twins/$n.json /tmp/twins/
    python3 tools/make_quant_twins.py expand /tmp/twins/$n /tmp/twins/$n.gguf || echo "twin $n failed"
  fi
done
[ "${1:-}" = stage ] && { ls -la /tmp/stage /tmp/twins; exit 0; }
python3 -c "import cupy, gguf, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" || exit 1
export REALIZAR_TWINS=/tmp/twins
# the tiny qwen3moe models of tests/gpu/test_moe.py, made where transformers is (tests/support/moe_models.py) and carried
[ -d .device/moe ] && export REALIZAR_MOE_MODELS=$REPO/.device/moe
# the tiny qwen35 hybrids of tests/gpu/test_hybrid_gpu.py (tests/support/hybrid_models.py) and gpt-oss
# models of tests/gpu/test_gptoss_gpu.py (tests/support/gptoss_models.py), likewise made here and carried
[ -d .device/hybrid ] && export REALIZAR_HYBRID_MODELS=$REPO/.device/hybrid
[ -d .device/gptoss ] && export REALIZAR_GPTOSS_MODELS=$REPO/.device/gptoss
[ -f "$SMOL" ] && export REALIZAR_REAL_SMOL=$SMOL
# the prebuilt kernels, current for this tree (this machine's nvcc: 16 cores make it quick)
before=$(sha256sum realizar_backend/kernels/cubin/manifest.json 2>/dev/null)
t0=$(date +%s)
python3 tools/build_kernels.py --jobs 16 2>&1 | tail -3 || echo "build_kernels failed"
if [ "$before" != "$(sha256sum realizar_backend/kernels/cubin/manifest.json 2>/dev/null)" ]; then
  tar -cJf "$OUT/cubin.tar.xz" -C realizar_backend/kernels cubin && echo "prebuilt kernels rebuilt in $(( $(date +%s) - t0 )) s: $OUT/cubin.tar.xz"
fi
# bytecode, as `pip install` leaves it (a cold start would otherwise time Python compiling sources)
python3 -m compileall -q -j 0 /tmp/site "$REPO/realizar_backend" >/dev/null 2>&1 || true
pkill -f "bentoml serve" 2>/dev/null && sleep 2   # servers left by an earlier call on a warm machine

# ---------------------------------------------------------------- tests
rc=0
if has tests; then
  bash tools/gpu_tests.sh ${PYTEST_PATHS:-tests/gpu/test_*.py} || rc=1
fi

# ---------------------------------------------------------------- kernel benchmarks
if has kbench; then
  if [[ " ${KBENCH:-mmq attn} " == *" mmq "* ]]; then
    python3 benchmarks/mmq_bench.py ${MMQ_BENCH_ARGS:-} --json /tmp/bench/k_mmq.json 2>&1 | tail -70 || echo "mmq_bench failed"
  fi
  if [[ " ${KBENCH:-mmq attn} " == *" attn "* ]]; then
    python3 benchmarks/attn_bench.py --json /tmp/bench/k_attn.json > /tmp/attn_bench.txt 2>&1 || { echo "attn_bench failed:"; grep -v "sys.excepthook\|^Original exception\|^$" /tmp/attn_bench.txt | head -60; }
    tail -40 /tmp/attn_bench.txt
  fi
  python3 - "$OUT" <<'PY'
import json, sys, os
out = {}
for n in ("mmq", "attn"):
    try:
        out[n] = json.load(open(f"/tmp/bench/k_{n}.json"))
    except Exception as e:
        out[n] = {"error": str(e)}
json.dump(out, open(f"{sys.argv[1]}/kbench.json", "w"), indent=1)
PY
fi

# ---------------------------------------------------------------- realizar bench
bench() {  # name json-suffix args...
  local n=$1 tag=$2; shift 2
  python3 -m realizar_backend.cli bench --model /tmp/twins/$n.gguf --backend cuda "$@" \
    --json "/tmp/bench/${n}_${tag}.json" 2>&1 | grep -E '^\|' | grep -v -- '---' | grep -v '^| model' || echo "bench $n $tag failed"
}
if has bench; then
  for n in ${BENCH_TWINS:-smol135 qwen05 gemma270 qwen15}; do
    [ -f /tmp/twins/$n.gguf ] && bench $n short --prompt-tokens 512 --gen-tokens 128 --repetitions 5
  done
  for n in ${BATCH_TWINS:-qwen15}; do
    [ -f /tmp/twins/$n.gguf ] || continue
    for b in $BATCHES; do
      bench $n batch$b --batch $b --prompt-tokens 128 --gen-tokens 128 --repetitions 3
    done
    for d in $DEPTHS; do
      bench $n depth$d --depth $d --prompt-tokens $d --gen-tokens 128 --repetitions 2
    done
    for bd in ${DEPTH_BATCHES:-}; do        # BATCH:DEPTH, e.g. 16:4096
      bench $n b${bd%%:*}d${bd##*:} --batch ${bd%%:*} --depth ${bd##*:} --prompt-tokens 0 --gen-tokens 128 --repetitions 2
    done
    for b in $CONSTRAINED_BATCHES; do
      for m in all half; do
        bench $n json${m}$b --batch $b --constrained $m --prompt-tokens 0 --gen-tokens 128 --repetitions 3
      done
    done
  done
fi

# ---------------------------------------------------------------- vLLM beside us
if has vllm; then
  LT_TWIN=${LT_TWIN:-qwen15} bash tools/vllm_serve_bench.sh
fi

# ---------------------------------------------------------------- serving
serve_up() {  # model port [env...]: bentoml serve on the GPU in the background, wait for /readyz
  local m=$1 port=$2 i; shift 2
  env REALIZAR_MODEL=$m REALIZAR_MODEL_NAME=$(basename $m .gguf) REALIZAR_BACKEND=cuda "$@" \
    setsid python3 -m bentoml serve service:Realizar --host 127.0.0.1 --port $port > "/tmp/serve_$port.log" 2>&1 &
  for i in $(seq 1 240); do curl -sf 127.0.0.1:$port/readyz >/dev/null && return 0; sleep 0.5; done
  echo "server on port $port never became ready"; tail -20 "/tmp/serve_$port.log"; return 1
}
serve_down() { pkill -f "port $1" ; sleep 2; }
lt_warm() {  # port: with LT_WARMUP=1, two runs of the loadtest first (graphs, cuBLAS, allocator), not measured:
  # a prompt step's graph is captured the second time its shape comes, so one run of as many requests left the
  # captures to the measured run (~5% slower than the runs after it); prompts of other seeds, or the measured
  # run's would all be found in the prefix cache
  [ "${LT_WARMUP:-0}" = 1 ] || return 0
  for s in 1 2; do
    python3 -m realizar_backend.cli loadtest http://127.0.0.1:$1 --clients $LT_CLIENTS --requests $((4 * LT_CLIENTS)) \
      --seed $s --prompt-tokens 128 --max-tokens 128 >/dev/null 2>&1
  done
}
lt_line() {  # file tag: one line of a loadtest's figures
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); q=lambda k: (d.get(k) or {}).get('p50') or 0
print(sys.argv[2], f\"{d['output_tokens_per_s']:.1f} tok/s, errors {d['requests']['errors']}, TTFT p50 {q('ttft_s'):.3f} s,\",
      f\"ITL p50 {q('itl_s') * 1e3:.1f} ms, TPOT p50 {q('tpot_s') * 1e3:.1f} ms, {d['elapsed_s']:.2f} s\")" "$1" "$2" 2>/dev/null
}
if has serve && python3 -c "import bentoml" 2>/dev/null; then
  gen() { python3 -m realizar_backend.cli generate "$@" --max-tokens 32 2>>/tmp/generate.err; }
  if [ -f "$SMOL" ]; then
    gen "The capital of France is" --model $SMOL --backend cpu > /tmp/g_cpu.txt
    gen "The capital of France is" --model $SMOL --backend cuda > /tmp/g_cuda.txt
    gen "What is the capital of France?" --chat --model $SMOL --backend cpu > /tmp/c_cpu.txt
    echo "generate cpu : $(head -c 200 /tmp/g_cpu.txt | tr '\n' ' ')"
    echo "generate cuda: $(head -c 200 /tmp/g_cuda.txt | tr '\n' ' ')"
    cmp -s /tmp/g_cpu.txt /tmp/g_cuda.txt && echo "GENERATE_GPU_EQUALS_CPU yes" || echo "GENERATE_GPU_EQUALS_CPU no"
    if serve_up $SMOL 3901 REALIZAR_MAX_NUM_SEQS=16 REALIZAR_CONTEXT_LENGTH=1024; then
      curl -s 127.0.0.1:3901/v1/chat/completions -H 'content-type: application/json' -d '{"model": "smol135",
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}' \
        > /tmp/serve_chat.json
      python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['choices'][0]['message']['content'])" \
        /tmp/serve_chat.json > /tmp/c_srv.txt
      echo "service chat (cuda): $(head -c 200 /tmp/c_srv.txt | tr '\n' ' ')"
      cmp -s /tmp/c_cpu.txt /tmp/c_srv.txt && echo "SERVICE_GPU_EQUALS_CPU yes" || echo "SERVICE_GPU_EQUALS_CPU no"
      serve_down 3901
    fi
  fi
  if [ -f $LT_MODEL ] && serve_up $LT_MODEL 3902 REALIZAR_CONTEXT_LENGTH=4096; then
    grep -h "ready: serving\|cuda backend ready" /tmp/serve_3902.log | tail -2
    if [ "${PYSPY:-0}" = 1 ] && [ -x /tmp/site/bin/py-spy ]; then   # sample the worker (all threads) mid-run
      wpid=$(pgrep -f "_bentoml_impl.worker" | head -1)
      (sleep 2; /tmp/site/bin/py-spy record --pid "$wpid" --duration 3 --rate 100 --threads --gil --nonblocking \
        --format raw -o "$OUT/pyspy_gil.txt" >/dev/null 2>&1) &
      spy=$!
    fi
    lt_warm 3902
    # the GPU's busy fraction while the loadtest runs (NVML's utilization: time a kernel ran, per 50 ms)
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 50 > /tmp/lt_util.txt 2>/dev/null &
    util=$!
    python3 -m realizar_backend.cli loadtest http://127.0.0.1:3902 --clients $LT_CLIENTS --requests $((4 * LT_CLIENTS)) \
      --prompt-tokens 128 --max-tokens 128 --json /tmp/bench/lt.json 2>/dev/null | tail -30
    kill $util 2>/dev/null
    [ -n "${spy:-}" ] && wait $spy
    lt_line /tmp/bench/lt.json LT
    python3 -c "import sys; v = [float(x) for x in open(sys.argv[1]) if x.strip()]; v = v[2:-2] or v
print(f'LT GPU utilization: mean {sum(v) / max(1, len(v)):.1f}% over {len(v)} samples of 50 ms')" /tmp/lt_util.txt 2>/dev/null
    if [ "$SOAK_REQUESTS" -gt 0 ]; then
      python3 -m realizar_backend.cli loadtest http://127.0.0.1:3902 --clients $LT_CLIENTS --requests $SOAK_REQUESTS \
        --prompt-tokens 128 --max-tokens 64 --random-cancel 0.3 --json /tmp/bench/soak.json 2>/dev/null | tail -30
    fi
    curl -s 127.0.0.1:3902/metrics | grep -E '^realizar_(graph|kv|requests_running|gpu_memory|preempt)' | head -20
    serve_down 3902
  fi
  # $LT_VARIANTS: server settings to compare, ';'-separated ("REALIZAR_X=1 REALIZAR_Y=2;REALIZAR_X=3"), each
  # a fresh server on the $LT_TWIN twin and the same loadtest (/tmp/bench/lt_vN.json, in serve.json)
  IFS=';' read -ra variants <<< "${LT_VARIANTS:-}"
  for i in "${!variants[@]}"; do
    read -ra venv <<< "${variants[$i]}"
    echo "== loadtest variant v$i: ${venv[*]}"
    serve_up $LT_MODEL 3902 REALIZAR_CONTEXT_LENGTH=4096 "${venv[@]}" || continue
    lt_warm 3902
    python3 -m realizar_backend.cli loadtest http://127.0.0.1:3902 --clients $LT_CLIENTS --requests $((4 * LT_CLIENTS)) \
      --prompt-tokens 128 --max-tokens 128 --json /tmp/bench/lt_v$i.json 2>/dev/null | tail -30
    lt_line /tmp/bench/lt_v$i.json "LT_V$i ${venv[*]}"
    serve_down 3902
  done
fi

# ---------------------------------------------------------------- ours beside llama.cpp, twin by twin
if has peers; then
  PEER_DEADLINE=${PEER_DEADLINE:-$(( ${CALL_LIMIT_S:-590} - SECONDS - 150 ))} bash tools/peers.sh ${PEER_TWINS:-qwen7}
fi

# ---------------------------------------------------------------- one engine per GPU
if has workers && [ -f $LT_MODEL ] && python3 -c "import bentoml" 2>/dev/null; then
  echo "GPUs: $(nvidia-smi -L | wc -l)"
  for entry in ${WORKER_COUNTS:-1 2}; do
    n=${entry%%:*}; f=0; key=workers$n
    if [ "$entry" != "$n" ]; then f=${entry#*:}; key=workers${n}_fe$f; fi
    fes=$f; [ "$fes" = 0 ] && fes=$n
    echo "== $n engine(s), $fes front end(s)"
    serve_up $LT_MODEL 3903 REALIZAR_CONTEXT_LENGTH=4096 REALIZAR_WORKERS=$n REALIZAR_FRONT_ENDS=$f || continue
    for i in $(seq 1 240); do   # /readyz says one front end and one engine are ready: wait for all of them
      m=$(curl -s 127.0.0.1:3903/metrics)
      [ "$(echo "$m" | grep -c '^realizar_engine_status{.*status="ready".*} 1.0')" = "$n" ] \
        && [ "$(echo "$m" | grep -c '^realizar_worker_status{.*status="ready".*} 1.0')" = "$fes" ] && break
      sleep 0.5
    done
    curl -s 127.0.0.1:3903/metrics | grep -E '^realizar_(engine|worker)_status' | grep ' 1.0$'
    # warm-up as lt_warm's: two full runs of other seeds, so that each engine has captured the prompt steps'
    # shapes (the second time a shape comes) and the measured run's prompts are not in any prefix cache;
    # LT_CLIENTS clients per GPU
    c=$((LT_CLIENTS * n))
    for s in 1 2; do
      python3 -m realizar_backend.cli loadtest http://127.0.0.1:3903 --clients $c --requests $((4 * c)) \
        --seed $s --prompt-tokens 128 --max-tokens 128 >/dev/null 2>&1
    done
    # the front ends' CPU time over the measured run (one core = 1.0): where HTTP handling would be the limit
    fe=$(pgrep -f "_bentoml_impl.worker" | tr '\n' ' ')
    cpu_of() { local p t=0; for p in $fe; do t=$(awk -v t=$t '{print t + $14 + $15}' /proc/$p/stat 2>/dev/null || echo $t); done; echo $t; }
    cpu0=$(cpu_of); t0=$(date +%s.%N)
    python3 -m realizar_backend.cli loadtest http://127.0.0.1:3903 --clients $c --requests $((8 * c)) \
      --seed 3 --prompt-tokens 128 --max-tokens 128 --json /tmp/bench/$key.json 2>/dev/null | tail -40
    cpu1=$(cpu_of); t1=$(date +%s.%N)
    python3 -c "import sys; c0, c1, t0, t1 = map(float, sys.argv[1:5]); print(f'FRONT_END_CPU {(c1 - c0) / 100 / (t1 - t0):.2f} cores over {sys.argv[5]} front end(s)')" \
      "$cpu0" "$cpu1" "$t0" "$t1" "$(echo $fe | wc -w)" | tee /tmp/bench/${key}_fe.txt
    curl -s 127.0.0.1:3903/metrics | grep -E '^realizar_(engine_status|requests_total|generation_tokens_total|gpu_memory_used_bytes|requests_running)' \
      | grep -v ' 0.0$' | tee /tmp/bench/${key}_metrics.txt
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader
    serve_down 3903
    # shared engines (several front ends) end after the serving process: wait for their GPU memory
    for i in $(seq 1 60); do pgrep -f "realizar_backend.engine.(shared|process)" >/dev/null || break; sleep 0.5; done
  done
  WORKER_COUNTS="${WORKER_COUNTS:-1 2}" python3 - <<'PY'
import json, os
r = {}
entries = os.environ["WORKER_COUNTS"].split()
keys = {e: f"workers{e.split(':')[0]}" + (f"_fe{e.split(':')[1]}" if ":" in e else "") for e in entries}
for e, key in keys.items():
    try:
        rep = json.load(open(f"/tmp/bench/{key}.json"))
    except Exception as err:
        r[key] = {"error": str(err)}
        continue
    delta = (rep.get("server") or {}).get("counters_delta", {})
    r[key] = {"tok_s": rep["output_tokens_per_s"], "errors": rep["requests"]["errors"],
              "requests_by_engine": {k: v for k, v in delta.items() if k.startswith("realizar_requests_total")
                                     and 'engine="' in k and v},
              "completed": rep["requests"]["completed"], "tpot_p50_s": (rep["tpot_s"] or {}).get("p50"),
              "ttft_p50_s": (rep.get("ttft_s") or {}).get("p50"),
              "front_end": open(f"/tmp/bench/{key}_fe.txt").read().strip(),
              "metrics": open(f"/tmp/bench/{key}_metrics.txt").read().splitlines()}
for e, key in keys.items():
    if key != "workers1" and "tok_s" in r.get("workers1", {}) and "tok_s" in r.get(key, {}):
        r["speedup" + key.removeprefix("workers")] = r[key]["tok_s"] / r["workers1"]["tok_s"]
        print(f"WORKERS_SPEEDUP {r[key]['tok_s'] / r['workers1']['tok_s']:.2f}x ({key}: {r[key]['tok_s']:.0f} vs 1 GPU "
              f"{r['workers1']['tok_s']:.0f} tok/s; TTFT p50 {r[key]['ttft_p50_s']} s; errors "
              f"{r['workers1']['errors']} / {r[key]['errors']}; {r[key]['front_end']})")
json.dump(r, open("/tmp/bench/workers.json", "w"), indent=1)
PY
fi
if has serve || has workers; then
  python3 - "$OUT" <<'PY'
import json, sys
out = {}
for n in ("lt", "soak", "workers") + tuple(f"lt_v{i}" for i in range(8)):
    try:
        out[n] = json.load(open(f"/tmp/bench/{n}.json"))
    except Exception:
        pass
json.dump(out, open(f"{sys.argv[1]}/serve.json", "w"), indent=1)
PY
fi

# ---------------------------------------------------------------- cold start
if has cold && [ -f /tmp/twins/qwen15.gguf ]; then
  bash tools/cold_start.sh /tmp/twins/qwen15.gguf
fi

# ---------------------------------------------------------------- llama.cpp beside us
if has llamacpp; then
  # the build (~270 s on 16 cores) gets what is left of the call's limit after the benchmarks (~25 s;
  # ~2 min with the loadtests); cut off, it resumes on the next call
  left=$(( ${CALL_LIMIT_S:-590} - SECONDS - ${LLAMACPP_BENCH_S:-$([ -n "${LLAMACPP_LT_CLIENTS:-}" ] && echo 200 || echo 100)} ))
  LLAMACPP_TARGETS=${LLAMACPP_TARGETS:-llama-bench llama-batched-bench${LLAMACPP_LT_CLIENTS:+ llama-server}} \
  LLAMACPP_BUILD_TIMEOUT=${LLAMACPP_BUILD_TIMEOUT:-$(( left > 5 ? left : 5 ))} bash tools/llama_cpp_bench.sh ${LLAMACPP_MODE:-all}
  if [ -n "${LLAMACPP_LT_CLIENTS:-}" ] && [ -x /tmp/llamacpp/build/bin/llama-server ]; then
    np=$(echo $LLAMACPP_LT_CLIENTS | tr ' ' '\n' | sort -n | tail -1)
    LD_LIBRARY_PATH=$(cat /tmp/llamacpp/ldpath 2>/dev/null)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
      setsid /tmp/llamacpp/build/bin/llama-server -m ${LLAMACPP_MODEL:-/tmp/twins/qwen15.gguf} -ngl 99 -fa on -np $np -c $(( np * 512 )) \
      --host 127.0.0.1 --port 3910 > /tmp/llama_server.log 2>&1 &
    lpid=$!
    for i in $(seq 1 120); do curl -sf 127.0.0.1:3910/health >/dev/null && break; sleep 0.5; done
    python3 -m realizar_backend.cli loadtest http://127.0.0.1:3910 --clients $np --requests $np \
      --prompt-tokens 128 --max-tokens 128 >/dev/null 2>&1      # warm-up: graph captures, allocator
    for c in $LLAMACPP_LT_CLIENTS; do
      python3 -m realizar_backend.cli loadtest http://127.0.0.1:3910 --clients $c --requests $((4 * c)) \
        --prompt-tokens 128 --max-tokens 128 --json /tmp/llamacpp/results/lt$c.json 2>/dev/null | tail -12 \
        || { echo "loadtest through llama-server at $c clients failed"; tail -5 /tmp/llama_server.log; }
    done
    kill $lpid; sleep 1
    python3 - "$OUT/llamacpp.json" <<'PY'
import glob, json, re, sys
r = json.load(open(sys.argv[1]))
for f in sorted(glob.glob("/tmp/llamacpp/results/lt*.json")):
    c = re.search(r"lt(\d+)", f).group(1)
    rep = json.load(open(f))
    r.setdefault("server_loadtest", {})[c] = rep
    r["summary"][f"server_c{c}"] = round(rep["output_tokens_per_s"], 1)
json.dump(r, open(sys.argv[1], "w"), indent=1)
print("LLAMACPP_SERVER " + json.dumps({k: v for k, v in r["summary"].items() if k.startswith("server")}))
PY
  fi
fi

# ---------------------------------------------------------------- summary
python3 - "$OUT" "$rc" <<'PY'
import glob, json, os, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
s = {"pytest_rc": rc}
try:
    r = ET.parse(f"{out}/junit.xml").getroot()
    ts = r if r.tag == "testsuite" else r.find("testsuite")
    s.update({k: int(ts.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    s["failed"] = [c.get("classname") + "::" + c.get("name") for c in ts.iter("testcase")
                   if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:
    s["junit"] = str(e)
full, s["bench"] = {}, {}
for f in sorted(glob.glob("/tmp/bench/*_*.json")):
    if os.path.basename(f).startswith(("k_", "lt", "soak")):
        continue
    r = json.load(open(f))
    key = os.path.basename(f)[:-5]
    full[key] = r
    s["bench"][key] = {k: round(r[k]["median"], 1) for k in ("pp_tok_s", "tg_tok_s", "tg_sampled_tok_s",
                                                             "tg_constrained_tok_s") if r.get(k)}
    if r.get("constrained_vs_plain"):
        s["bench"][key].update(constrained_vs_plain=round(r["constrained_vs_plain"], 3),
                               mask_ms_per_step=round(r["mask_ms_per_step"]["median"], 3))
try:
    s["llamacpp"] = json.load(open(f"{out}/llamacpp.json"))["summary"]
except Exception:
    pass
json.dump(full, open(f"{out}/bench.json", "w"), indent=1)
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(s, indent=1))
PY
exit $rc
