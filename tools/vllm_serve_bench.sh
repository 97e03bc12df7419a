#!/usr/bin/env bash
# vLLM beside us on a served shape (tools/device_check.sh's `vllm` stage): `vllm serve` on a model dir of
# the shared vLLM kit (bf16 random weights, `--load-format dummy`) and `vllm bench serve` at each
# concurrency, the same shape as the serve stage's `realizar loadtest` (128-token prompts, 128 new
# tokens, four times as many requests as clients, after one unmeasured run of as many requests as
# clients). The kit's parts are carried into /tmp/vllm_chunks by calls of their own (the shared
# tools/vllm_kit/README.md, "Carry"); its install.sh runs here once a machine (/tmp/vllm_env.sh).
#   bash tools/vllm_serve_bench.sh
# Settings (environment): VLLM_MODEL (a model dir, default /tmp/vllm_models/$LT_TWIN, LT_TWIN qwen15),
#   VLLM_CONCURRENCY ("64"), VLLM_PORT (8011), VLLM_START_S (seconds the server may take to answer
#   /health, 420), VLLM_CHUNKS (/tmp/vllm_chunks), VLLM_ENV (the kit's environment file, written by its
#   install.sh: /tmp/vllm_env.sh), VLLM_CLI (the vLLM command, default
#   `python3 -m vllm.entrypoints.cli.main`, which the kit's pip target keeps).
# Output: a line per concurrency, $OUT/vllm_cC.json (vLLM's own result file) and $OUT/vllm.json
#   {"cC": {output_tok_s, ttft_p50_ms, itl_p50_ms, completed, failed}}; the server's log in $OUT/vllm_serve.log.
set -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/.device/out}
MODEL=${VLLM_MODEL:-/tmp/vllm_models/${LT_TWIN:-qwen15}}
PORT=${VLLM_PORT:-8011}
CHUNKS=${VLLM_CHUNKS:-/tmp/vllm_chunks}
CLI=${VLLM_CLI:-python3 -m vllm.entrypoints.cli.main}
ENVF=${VLLM_ENV:-/tmp/vllm_env.sh}
# no torch.compile and full CUDA graphs for decode steps: a quick start on a fresh machine (the kit's advice)
COMPILE='{"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY"}'
mkdir -p "$OUT"

if [ ! -f "$ENVF" ]; then
  [ -f "$CHUNKS/install.sh" ] || { echo "vllm: no $CHUNKS/install.sh (carry the kit's parts first)"; exit 1; }
  (cd "$CHUNKS" && bash install.sh > "$OUT/vllm_install.log" 2>&1) \
    || { echo "vllm: install failed"; tail -5 "$OUT/vllm_install.log"; exit 1; }
fi
# shellcheck disable=SC1090
. "$ENVF"
[ -d "$MODEL" ] || { echo "vllm: no model dir $MODEL"; exit 1; }

setsid $CLI serve "$MODEL" --load-format dummy --port "$PORT" --generation-config vllm \
  --compilation-config "$COMPILE" > "$OUT/vllm_serve.log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null; sleep 2; kill -9 -- -$server 2>/dev/null' EXIT
up=0
for _ in $(seq "${VLLM_START_S:-420}"); do
  curl -sf "127.0.0.1:$PORT/health" > /dev/null && { up=1; break; }
  kill -0 $server 2>/dev/null || break
  sleep 1
done
[ $up = 1 ] || { echo "vllm: the server did not come up"; tail -20 "$OUT/vllm_serve.log"; exit 1; }

bench() {  # concurrency requests [result file]
  $CLI bench serve --backend vllm --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --dataset-name random \
    --random-input-len 128 --random-output-len 128 --ignore-eos --max-concurrency "$1" --num-prompts "$2" \
    ${3:+--save-result --result-dir "$OUT" --result-filename "$3"}
}
for c in ${VLLM_CONCURRENCY:-64}; do
  bench "$c" "$c" > "$OUT/vllm_warm_c$c.log" 2>&1
  bench "$c" $((4 * c)) "vllm_c$c.json" > "$OUT/vllm_c$c.log" 2>&1 || echo "vllm: bench at $c failed"
done

python3 - "$OUT" ${VLLM_CONCURRENCY:-64} <<'PY'
import json, os, sys
out, report = sys.argv[1], {}
for c in sys.argv[2:]:
    try:
        r = json.load(open(os.path.join(out, f"vllm_c{c}.json")))
    except (OSError, ValueError):
        print(f"VLLM c{c}: no result")
        continue
    row = {"output_tok_s": round(r["output_throughput"], 1), "ttft_p50_ms": round(r.get("median_ttft_ms", -1), 1),
           "itl_p50_ms": round(r.get("median_itl_ms", -1), 2), "completed": r["completed"],
           "failed": r.get("failed", 0)}
    report[f"c{c}"] = row
    print(f"VLLM c{c}: {row['output_tok_s']:,.1f} output tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
          f"ITL p50 {row['itl_p50_ms']} ms, {row['completed']} completed, {row['failed']} failed")
json.dump(report, open(os.path.join(out, "vllm.json"), "w"), indent=1)
PY
