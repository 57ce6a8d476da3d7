#!/usr/bin/env bash
# Session 27's third call (issue 22, acceptance 3): the DFlash and the DFlash2 draft step at
# the Qwen3-8B shape (5-layer drafts, published DFlash2 sizes) now that the draft's block pass
# replays as a CUDA graph; alternating, graphs on (the default), then one round with graphs off.
#   run(command="bash tools/gpu-bench/session27c.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
RES=${OUT:-/tmp}/s27c
M=/root/gpu-bench-models
mkdir -p "$RES" "$M"
ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; }
$PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" > /dev/null 2>&1 || echo "make_dflash2 failed"
echo "### models ($((SECONDS - T0)) s)"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1 --micro-iters 30)
med() { grep -h "^| draft forward Q=" "$1" | head -n 1 | awk -F'|' '{gsub(/ /,"",$5); print $5}'; }
echo "| round | graphs | DFlash draft step (us) | DFlash2 draft step (us) | ratio | draft graphs (DFlash2 run) |"
echo "|---|---|---:|---:|---:|---|"
round() {  # $1 round, $2 graphs 0/1
  for d in draft-agree draft2; do
    DFLASH_CUDA_GRAPHS=$2 timeout 90 /tmp/stash/dflash "${common[@]}" --draft "$M/$d" --out "$RES/m-$d-$1" \
      > "$RES/m-$d-$1.log" 2>&1 || { echo "micro $d rc $?"; tail -3 "$RES/m-$d-$1.log"; }
  done
  a=$(med "$RES/m-draft-agree-$1/micro.md"); b=$(med "$RES/m-draft2-$1/micro.md")
  r=$($PY -c "print(f'{float(\"$b\")/float(\"$a\"):.3f}')" 2>/dev/null || echo "?")
  g=$(grep -h 'CUDA graphs (draft)' "$RES/m-draft2-$1/micro.md" | cut -c1-120)
  echo "| $1 | $2 | ${a:-?} | ${b:-?} | $r | ${g:--} |"
}
for r in 1 2 3 4; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-300} ] && break
  round $r 1
done
round off 0
echo "done in $((SECONDS - T0)) s"
