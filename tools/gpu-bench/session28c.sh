#!/usr/bin/env bash
# (The trial `pdl` this call tested was removed after it: every capture failed with CUDA_ERROR_NOT_SUPPORTED; docs/perf.md, session 28.)
# Session 28's third call (issue 20): (1) tests/fused_cuda.rs with the trial `pdl` on
# (programmatic edges between dflash kernels in every CUDA graph; graphs vs eager bit for bit,
# verify == decode, every family, batched == alone, attention with the split merge in the
# kernel now loading all its elements at once); (2) bench --micro alternating default / pdl on
# qwen3_moe and qwen3_5_moe; (3) the family sweep of qwen3 and qwen3_5 (the dense rows: step,
# verify(16), draft at the published depth) with whatever time is left.
#   run(command="bash tools/gpu-bench/session28c.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s28c
M=/dev/shm/fam-models
mkdir -p "$R" "$M"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
DFLASH_TRY=pdl DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads=1 --nocapture \
  attention verify_rows graphs every_family batched forward_batch dflash2_draft > /tmp/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
grep -E "^test |test result|panicked|GraphReport" /tmp/tests.txt | grep -v 'deepseek_v3: GraphReport' | cut -c1-170 | head -30
grep -A8 "panicked" /tmp/tests.txt | head -24
echo "### tests (pdl) done in $((SECONDS - T0)) s"
micro() {  # label fam -> the verify / draft medians (us) of micro.md
  local d="$R/$1-$2"
  timeout 100 /tmp/stash/dflash bench --micro --model "$M/$2/target" --draft "$M/$2/draft" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1,16 --micro-iters 20 --out "$d" > "$d.log" 2>&1 || { echo "$1 $2 rc $?"; tail -3 "$d.log"; }
  grep -hE "^\| (verify|draft) forward" "$d/micro.md" | awk -F'|' '{gsub(/ +$/,"",$2); gsub(/ /,"",$5); printf "%s %s; ", $2, $5}'
  grep -h 'programmatic' "$d/micro.md" | head -2 | cut -c1-150 | tr '\n' ' '; echo
}
for fam in ${FAMS:-qwen3_moe qwen3_5_moe}; do
  [ $((SECONDS - T0)) -gt 330 ] && { echo "$fam skipped (deadline)"; continue; }
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > "$R/$fam-build.log" 2>&1 || { echo "$fam build failed"; tail -3 "$R/$fam-build.log"; continue; }
  for round in 1 2; do
    echo -n "$fam r$round default: "; micro d$round $fam
    echo -n "$fam r$round pdl:     "; DFLASH_TRY=pdl micro p$round $fam
  done
  rm -rf "$M/$fam"
done
left=$((570 - (SECONDS - T0)))
if [ $left -gt 150 ]; then
  RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${SWEEP:-qwen3 qwen3_5}" DEADLINE=$((left - 130)) OUT= \
    bash "$here/families.sh" 2>&1 | tail -16
else
  echo "sweep skipped ($left s left)"
fi
echo "done in $((SECONDS - T0)) s"
