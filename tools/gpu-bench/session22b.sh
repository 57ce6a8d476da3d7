#!/usr/bin/env bash
# Second H200 call of session 22 (issue 20): every kernel of a MoE verify forward, timed by
# Nsight Compute. qwen3_moe and gpt_oss sweep models (families.py); per family and q in 1, 16:
# `DFLASH_PROFILE=ncu dflash bench --micro --micro-q q --micro-iters 2` under
# `ncu --profile-from-start off` (only the timed verify forwards are collected: 2 forwards),
# one metric (gpu__time_duration); ncu_summary.py prints launches, total and mean us per kernel.
#   run(command="tools/gpu-bench/session22b.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
. "$(dirname "$0")/env.sh" dflash
RES=${OUT:-/tmp}/s22b
M=/dev/shm/fam-models
mkdir -p "$RES" "$M"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for fam in ${FAMS:-qwen3_moe gpt_oss}; do
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > "$RES/$fam-build.log" 2>&1 || { echo "$fam build failed"; tail -3 "$RES/$fam-build.log"; continue; }
  for q in 1 16; do
    DFLASH_PROFILE=ncu timeout 100 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      /tmp/stash/dflash bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 \
      --micro-context 128 --micro-q $q --micro-iters 2 > "$RES/$fam-q$q.csv" 2> "$RES/$fam-q$q.err" \
      || { echo "$fam q$q ncu rc $?"; tail -3 "$RES/$fam-q$q.err"; }
    echo "### $fam q=$q (2 forwards)"; $PY "$here/ncu_summary.py" "$RES/$fam-q$q.csv" | head -30
  done
  rm -rf "$M/$fam"
done
