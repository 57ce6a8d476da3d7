#!/usr/bin/env bash
# Session 31, third call (issue 22, acceptance 3): the DFlash and the DFlash2 draft step at the
# Qwen3-8B shape (5-layer drafts, published DFlash2 sizes), both with the two trials session 31b
# tested (DFLASH_TRY=narrow16,conv_epilogue), paired in each round; then, time allowing, one
# pair with the default kernels. 60 iterations a run.
# (Moved onto env.sh's dflash2_models / draft_step / ratio after the runs; same steps.)
#   run(command="bash tools/gpu-bench/session31c.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s31c
M=/root/gpu-bench-models
mkdir -p "$R" "$M"
dflash2_models "$M"
echo "### models in $((SECONDS - T0)) s"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1 --micro-iters 60)
rows=()
pair() {  # $1: round, $2: DFLASH_TRY
  for d in draft-agree draft2; do
    DFLASH_TRY=$2 timeout 90 /tmp/stash/dflash "${common[@]}" --draft "$M/$d" --out "$R/m-$d-$1" \
      > "$R/m-$d-$1.log" 2>&1 || { echo "micro $d $1 rc $?"; tail -3 "$R/m-$d-$1.log"; }
  done
  local a b
  a=$(draft_step "$R/m-draft-agree-$1/micro.md"); b=$(draft_step "$R/m-draft2-$1/micro.md")
  rows+=("| $1 | ${2:-none} | ${a:-?} | ${b:-?} | $(ratio "$b" "$a") |")
  echo "${rows[-1]}"
}
for r in 1 2 3 4 5; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-380} ] && break
  pair "t$r" narrow16,conv_epilogue
done
[ $((SECONDS - T0)) -lt ${DEADLINE_DEFAULT:-470} ] && pair d1 ""
grep -h "^| draft forward\|try=" "$R/m-draft2-t1/micro.md" 2>/dev/null | cut -c1-200
echo "| round | DFLASH_TRY | DFlash draft step (us) | DFlash2 draft step (us) | DFlash2 / DFlash |"
echo "|---|---|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo "done in $((SECONDS - T0)) s"
