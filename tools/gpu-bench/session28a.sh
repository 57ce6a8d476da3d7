#!/usr/bin/env bash
# Session 28's first call (issue 20). (1) session27d's tests of the review tidy (graphs vs eager
# for every family's target and draft, verify rows with ring rollbacks, DFlash2 on the device);
# (2) Nsight Compute per kernel (graphs off, so each launch is its own): a decode step (Q=1) of
# qwen3_moe and qwen3_5_moe, and the draft's proposal at Q=16 of qwen3_moe, qwen3_5_moe, gpt_oss
# (what still keeps the MoE steps under 60% of their floor and the drafts over 0.25x).
#   run(command="bash tools/gpu-bench/session28a.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s28a
M=/dev/shm/fam-models
mkdir -p "$R" "$M"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > $R/small.log 2>&1 || echo "small models: rc $?"
DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads=1 --nocapture \
  graphs verify_rows dflash2_draft > $R/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
grep -E "^test |test result|panicked" $R/tests.txt | cut -c1-160 | head -30
grep -A8 "panicked" $R/tests.txt | head -20
echo "### tests done in $((SECONDS - T0)) s"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for fam in ${FAMS:-qwen3_moe qwen3_5_moe gpt_oss}; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-470} ] && { echo "$fam skipped (deadline)"; continue; }
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > "$R/$fam-build.log" 2>&1 || { echo "$fam build failed"; tail -3 "$R/$fam-build.log"; continue; }
  for what in ncu ncu-draft; do
    [ "$fam" = gpt_oss ] && [ $what = ncu ] && continue
    q=1; [ $what = ncu-draft ] && q=16
    DFLASH_CUDA_GRAPHS=0 DFLASH_PROFILE=$what timeout 100 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      /tmp/stash/dflash bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 \
      --micro-context 128 --micro-q $q --micro-iters 2 > "$R/$fam-$what.csv" 2> "$R/$fam-$what.err" \
      || { echo "$fam $what ncu rc $?"; tail -3 "$R/$fam-$what.err"; }
    echo "### $fam $what q=$q (2 calls)"; $PY "$here/ncu_summary.py" "$R/$fam-$what.csv" | head -24
  done
  grep -h '"floor\|layers\|hidden' "$M/$fam/manifest.json" 2>/dev/null | head -5
  rm -rf "$M/$fam"
done
echo "done in $((SECONDS - T0)) s"
