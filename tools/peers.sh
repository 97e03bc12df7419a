#!/usr/bin/env bash
# Ours beside llama.cpp on shape twins, one queue of twins a GPU (tools/device_check.sh's `peers` stage,
# after its setup; carry .llamacpp as for the llamacpp stage, and each twin's .twins/NAME.head.gz + NAME.json):
#   bash tools/peers.sh NAME...
# Per twin, on its queue's GPU: expand it into /tmp/twins (unless there), `realizar bench` (a 512-token
# prompt and 128 new tokens; 16 and 64 sequences of 128 + 128), llama.cpp's llama-bench (pp512, tg128)
# and llama-batched-bench (1, 16, 64 streams), then delete a twin this script expanded (a GPU
# machine's disk holds a few large twins, not all of them).
# Settings (environment): PEER_TWINS_DIR (the heads, .twins), PEER_MODELS (where twins expand, /tmp/twins),
#   PEER_DEADLINE (seconds from the start after which no twin starts, 480),
#   PEER_GPUS (the GPUs, a queue each; default every GPU nvidia-smi lists, 0..PEER_QUEUES-1 with PEER_QUEUES),
#   PEER_BATCHES ("16 64"),
#   PEER_LLAMACPP_WORK (llama.cpp's build, shared by the queues: /tmp/llamacpp, the llamacpp stage's, so a
#   warm machine's is reused; built or unpacked once before the queues start, LLAMACPP_JOBS as there),
#   PEER_LLAMACPP (instead, a llama.cpp command run per twin with LLAMACPP_MODEL, LLAMACPP_WORK and OUT set;
#   it leaves OUT/llamacpp.json).
# Output: a line per twin, ours / llama.cpp (tok/s), and $OUT/peers.json: {twin: {"ours": {measure:
#   tok/s}, "llamacpp": {measure: tok/s}, "gpu": N}}; measures tg128, pp512, b16, b64 (S_TG for llama.cpp).
set -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-$REPO/.device/out}
WORK=${PEER_WORK:-/tmp/peers}
DEADLINE=${PEER_DEADLINE:-480}
BATCHES=${PEER_BATCHES:-16 64}
LLAMACPP_CMD=${PEER_LLAMACPP:-}
LLAMACPP_SHARED=${PEER_LLAMACPP_WORK:-/tmp/llamacpp}
TW=${PEER_TWINS_DIR:-$REPO/.twins}
M=${PEER_MODELS:-/tmp/twins}
mkdir -p "$OUT" "$WORK" "$M"
rm -rf "${WORK:?}"/*
t0=$(date +%s)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); queues=${PEER_QUEUES:-$ngpu}; [ "${queues:-0}" -ge 1 ] || queues=1
read -ra gpus <<< "${PEER_GPUS:-$(seq -s " " 0 $((queues - 1)))}"; queues=${#gpus[@]}

one() {  # gpu twin: every measure of one twin into $WORK/TWIN/
  local g=$1 n=$2 d=$WORK/$2 made=0 b
  mkdir -p "$d"
  if [ ! -f "$M/$n.gguf" ]; then
    [ -f "$TW/$n.head.gz" ] || { echo "peers: no $n.head.gz in $TW" > "$d/error"; return; }
    gunzip -c "$TW/$n.head.gz" > "$M/$n.head" && cp "$TW/$n.json" "$M/" \
      && python3 tools/make_quant_twins.py expand "$M/$n" "$M/$n.gguf" > "$d/expand.log" 2>&1 \
      || { echo "peers: twin $n not expanded" > "$d/error"; return; }
    made=1
  fi
  export CUDA_VISIBLE_DEVICES=$g
  python3 -m realizar_backend.cli bench --model "$M/$n.gguf" --backend cuda --prompt-tokens 512 \
    --gen-tokens 128 --repetitions 5 --json "$d/ours_short.json" > "$d/ours.log" 2>&1
  for b in $BATCHES; do
    python3 -m realizar_backend.cli bench --model "$M/$n.gguf" --backend cuda --batch "$b" \
      --prompt-tokens 128 --gen-tokens 128 --repetitions 3 --json "$d/ours_b$b.json" >> "$d/ours.log" 2>&1
  done
  if [ -n "$LLAMACPP_CMD" ]; then
    LLAMACPP_MODEL=$M/$n.gguf LLAMACPP_WORK=$WORK/llamacpp$g LLAMACPP_DEPTHS="" \
      LLAMACPP_NPL="1,$(echo $BATCHES | tr ' ' ',')" LLAMACPP_REPS=3 OUT=$d $LLAMACPP_CMD > "$d/llamacpp.log" 2>&1
  else
    LLAMACPP_MODEL=$M/$n.gguf LLAMACPP_WORK=$LLAMACPP_SHARED LLAMACPP_RESULTS=$d/llamacpp_results LLAMACPP_DEPTHS="" \
      LLAMACPP_NPL="1,$(echo $BATCHES | tr ' ' ',')" LLAMACPP_REPS=3 OUT=$d bash tools/llama_cpp_bench.sh bench \
      > "$d/llamacpp.log" 2>&1
  fi
  [ "$made" = 1 ] && rm -f "$M/$n.gguf" "$M/$n.head"
  unset CUDA_VISIBLE_DEVICES
}

queue() {  # gpu twins...: one after another, none started past the deadline
  local g=$1 n; shift
  for n in "$@"; do
    if [ $(( $(date +%s) - t0 )) -ge "$DEADLINE" ]; then mkdir -p "$WORK/$n"; echo "peers: past the deadline" > "$WORK/$n/error"; continue; fi
    one "$g" "$n"
  done
}

twins=("$@")
# llama.cpp built (or its prebuilt programs unpacked) once, for every queue
if [ -z "$LLAMACPP_CMD" ]; then
  LLAMACPP_WORK=$LLAMACPP_SHARED OUT=$WORK bash tools/llama_cpp_bench.sh build > "$WORK/llamacpp_build.log" 2>&1 \
    || echo "peers: llama.cpp not built ($WORK/llamacpp_build.log): $(tail -3 "$WORK/llamacpp_build.log")"
fi
pids=()
for ((q = 0; q < queues; q++)); do
  mine=()
  for ((i = q; i < ${#twins[@]}; i += queues)); do mine+=("${twins[$i]}"); done
  [ ${#mine[@]} -gt 0 ] || continue
  queue "${gpus[$q]}" "${mine[@]}" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

python3 - "$WORK" "$OUT/peers.json" "$BATCHES" "$@" <<'PY'
import json, os, sys
work, out, batches, names = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4:]

def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None

report = {}
for i, n in enumerate(names):
    d = os.path.join(work, n)
    r = {"ours": {}, "llamacpp": {}}
    if os.path.exists(os.path.join(d, "error")):
        r["error"] = open(os.path.join(d, "error")).read().strip()
    s = load(os.path.join(d, "ours_short.json"))
    if s:
        r["ours"]["tg128"] = round(s["tg_tok_s"]["median"], 1)
        r["ours"]["pp512"] = round(s["pp_tok_s"]["median"])
    for b in batches:
        s = load(os.path.join(d, f"ours_b{b}.json"))
        if s:
            r["ours"][f"b{b}"] = round(s["tg_tok_s"]["median"], 1)
    lc = (load(os.path.join(d, "llamacpp.json")) or {}).get("summary", {})
    for k, v in (("tg128", "tg128"), ("pp512", "pp512"), *((f"b{b}", f"batched_pp128_tg128_b{b}") for b in batches)):
        if v in lc:
            r["llamacpp"][k] = lc[v]
    report[n] = r
    cells = []
    for k in ("tg128", "pp512", *(f"b{b}" for b in batches)):
        o, l = r["ours"].get(k), r["llamacpp"].get(k)
        ratio = f" ({o / l:.2f}x)" if o and l else ""
        cells.append(f"{k} {o if o is not None else '-'} / {l if l is not None else '-'}{ratio}")
    print(f"PEERS {n}: " + ", ".join(cells) + (f"  [{r['error']}]" if "error" in r else ""))
json.dump(report, open(out, "w"), indent=1)
PY
