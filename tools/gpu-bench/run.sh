#!/usr/bin/env bash
# One H200 run: make random-weight Qwen3-8B-shape models, time the authors' reference and
# transformers generate on them (reference.py), then our engine (micro + end to end) on the same
# files, and print one table (summarize.py). From the repo root:
#   tools/gpu-bench/run.sh                      # on the GPU machine; binary in .device/dflash
#   SHAPE=tiny DEV=cpu DTYPE=float32 BIN=target/release/dflash PY=/work/pyenv/bin/python \
#     tools/gpu-bench/run.sh                    # CPU smoke test of the whole pipeline
# Options (env): SHAPE=qwen3-8b|qwen3.5-9b, REPEAT, MAXNEW, SKIP_REF=1 (models only, no
# PyTorch timing), SKIP_MICRO=1, SKIP_PROBE=1, AB_UNFUSED=1 (micro again with DFLASH_FUSED=0),
# AB_MMA=1 (micro again in batch-invariant mode, DFLASH_BATCH_INVARIANT=1),
# SKIP_E2E=1 (no end-to-end rows), T0_ROWS (the T=0 bench rows).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
SHAPE=${SHAPE:-qwen3-8b}
DEV=${DEV:-cuda}
DTYPE=${DTYPE:-bfloat16}
BIN=${BIN:-$root/.device/dflash}
PY=${PY:-python3}
RES=${RES:-${OUT:-/tmp}/gpu-bench}
MODELS=${MODELS:-/root/gpu-bench-models}
MAXNEW=${MAXNEW:-256}
REPEAT=${REPEAT:-3}
mkdir -p "$RES" "$MODELS"
case $DTYPE in bfloat16) ours_dtype=bf16 ;; float32) ours_dtype=f32 ;; float16) ours_dtype=f16 ;; esac
if [ "$DEV" != cpu ]; then
  export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$RES/gpu.txt"
fi
if [ "$DEV" != cpu ] && [ "${SKIP_PROBE:-0}" != 1 ]; then
  echo "== probe (candle op overhead, GEMV bandwidth)" >&2
  "$BIN" doctor --gpu-probe --device "$DEV" 2>&1 | tee "$RES/probe.txt" >&2 || echo "probe FAILED" >&2
fi
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"

echo "== reference (PyTorch) and model files" >&2
[ "${SKIP_REF:-0}" = 1 ] && ref_only="--models-only" || ref_only=""
$PY "$here/reference.py" $ref_only --shape "$SHAPE" --models "$MODELS" --out "$RES" --device "$DEV" \
  --dtype "$DTYPE" --max-new "$MAXNEW" --repeat "$REPEAT" 2>&1 | tee "$RES/reference.log" >&2

poll() { # tag: record GPU memory used (MiB) every 100 ms until killed
  if [ "$DEV" != cpu ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$RES/smi-$1.txt" &
    echo $!
  else echo 0; fi
}
stop() { [ "$1" != 0 ] && kill "$1" 2>/dev/null || true; }

if [ "${SKIP_MICRO:-0}" != 1 ]; then
echo "== ours: micro" >&2
pid=$(poll micro)
"$BIN" bench --micro --model "$MODELS/target" --draft "$MODELS/draft-agree" --device "$DEV" \
  --dtype "$ours_dtype" --micro-context 128 --micro-q 1,2,4,8,16 --micro-iters 30 \
  --out "$RES/micro" 2>&1 | tee "$RES/micro.log" >&2 || echo "micro FAILED" >&2
stop "$pid"
if [ "${AB_UNFUSED:-0}" = 1 ]; then
  echo "== ours: micro without the fused kernels (DFLASH_FUSED=0)" >&2
  DFLASH_FUSED=0 "$BIN" bench --micro --model "$MODELS/target" --draft "$MODELS/draft-agree" --device "$DEV" \
    --dtype "$ours_dtype" --micro-context 128 --micro-q 1,16 --micro-iters 30 \
    --out "$RES/micro-unfused" 2>&1 | tee "$RES/micro-unfused.log" >&2 || echo "micro (unfused) FAILED" >&2
fi
if [ "${AB_MMA:-0}" = 1 ]; then
  for v in "DFLASH_BATCH_INVARIANT=1:invariant"; do
    tag=${v#*:}; v=${v%%:*}
    echo "== ours: micro with $v" >&2
    env "$v" "$BIN" bench --micro --model "$MODELS/target" --draft "$MODELS/draft-agree" --device "$DEV" \
      --dtype "$ours_dtype" --micro-context 128 --micro-q 1,4,16 --micro-iters 30 \
      --out "$RES/micro-$tag" 2>&1 | tee "$RES/micro-$tag.log" >&2 || echo "micro ($v) FAILED" >&2
  done
fi
fi

if [ "${SKIP_E2E:-0}" != 1 ]; then
echo "== ours: end to end (block 16, like the reference)" >&2
row() { printf '{"model":"%s","draft":"%s","name":"%s"}' "$MODELS/target" "$MODELS/$1" "$2"; }
T0_ROWS=${T0_ROWS:-"$(row draft-agree draft-high),$(row draft-zero draft-zero)"}
echo "[$T0_ROWS]" > "$RES/matrix-t0.json"
echo "[$(row draft-agree draft-mid)]" > "$RES/matrix-t1.json"
for t in 0 1; do
  pid=$(poll e2e-t$t)
  "$BIN" bench --matrix "$RES/matrix-t$t.json" --prompts "$MODELS/prompts.jsonl" \
    --max-tokens "$MAXNEW" --repeat "$REPEAT" --cooldown 0 --warmup 1 --ignore-eos \
    --device "$DEV" --dtype "$ours_dtype" --block-size 16 --temperature $t --quiet \
    --out "$RES/e2e-t$t" 2>&1 | tee "$RES/e2e-t$t.log" >&2 || echo "e2e T=$t FAILED" >&2
  stop "$pid"
done
fi
echo "== table" >&2
$PY "$here/summarize.py" "$RES"
