#!/usr/bin/env bash
# First H200 call of session 22 (issue 20): where a MoE step's GPU time goes, kernel by kernel.
# Builds the qwen3_moe and gpt_oss sweep models (families.py, published widths, layers reduced),
# then per family: `dflash bench --micro` as the sweep runs it (wall times), and the same under
# Nsight Compute (`ncu --clock-control none`, one metric: gpu__time_duration) at q=1 and q=16,
# 3 iterations, every launch's duration as CSV ($OUT/s22a/<fam>-q<q>.csv). ncu_summary.py
# prints per kernel name: launches, total and mean microseconds.
#   run(command="tools/gpu-bench/session22a.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
. "$(dirname "$0")/env.sh" dflash
RES=${OUT:-/tmp}/s22a
M=/dev/shm/fam-models
mkdir -p "$RES" "$M"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for fam in ${FAMS:-qwen3_moe gpt_oss}; do
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > "$RES/$fam-build.log" 2>&1 || { echo "$fam build failed"; tail -3 "$RES/$fam-build.log"; continue; }
  common=(bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 --micro-context 128)
  timeout 120 /tmp/stash/dflash "${common[@]}" --micro-q 1,4,16 --micro-iters 20 > "$RES/$fam-micro.out" 2> "$RES/$fam-micro.err"
  echo "### $fam wall"; grep -E '^\| (verify forward|draft forward)' "$RES/$fam-micro.out"
  for q in 1 16; do
    timeout 200 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      /tmp/stash/dflash "${common[@]}" --micro-q $q --micro-iters 3 > "$RES/$fam-q$q.csv" 2> "$RES/$fam-q$q.err" \
      || { echo "$fam q$q ncu rc $?"; tail -3 "$RES/$fam-q$q.err"; }
    echo "### $fam q=$q kernels"; $PY "$here/ncu_summary.py" "$RES/$fam-q$q.csv" | head -40
  done
done
