#!/usr/bin/env bash
# Session 42 (issue 23): the concurrency table after `bench --concurrency` learned to serve the
# same first 8 requests at every level (level 1 one after another; before, level 1 was request
# 0 alone, whose tau 3.10 sat below the batch's 4.22). Qwen3-8B shape, controlled-acceptance
# draft, T = 1, block 8, c = 1 / 8 / 32, plain and DFlash, two rounds; then where a c = 8
# DFlash batch step goes: `DFLASH_PROFILE=gpu` (sections of a step) and, with time left
# (BUDGET s, default 520), ncu over two c = 8 batch steps (`DFLASH_PROFILE=ncu-batch`).
#   run(command="bash tools/gpu-bench/session42a.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
begin_session s42a
qwen3_models
echo "### models in $((SECONDS - T0)) s"
pair=(--model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16)
conc=(bench "${pair[@]}" --concurrency-prompt-len 128 --block-size 8 --max-tokens 128 --temperature 1.0)
only=(--concurrency-modes dflash)
for round in 1 2; do
  timeout 150 /tmp/stash/dflash "${conc[@]}" --concurrency 1,8,32 > "$R/table-$round.md" 2> "$R/table-$round.err" \
    || { echo "table rc $?"; tail -3 "$R/table-$round.err"; }
  echo "### round $round ($((SECONDS - T0)) s)"
  grep -E '^\| (plain|dflash)' "$R/table-$round.md" | cut -c1-200
done
grep -h '^switches' "$R/table-1.md"
DFLASH_PROFILE=gpu timeout 100 /tmp/stash/dflash "${conc[@]}" "${only[@]}" --concurrency 8 > "$R/profile8.md" 2> "$R/profile8.err" \
  || { echo "profile rc $?"; tail -3 "$R/profile8.err"; }
echo "### c = 8 DFlash batch steps with a verify, ms a step (DFLASH_PROFILE=gpu)"
batch_step_profile "$R/profile8.err"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ $((SECONDS - T0)) -lt $((${BUDGET:-520} - 90)) ]; then
  DFLASH_PROFILE=ncu-batch timeout 150 "$NCU" --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/dflash "${conc[@]}" "${only[@]}" --concurrency 8 \
    > "$R/ncu8.csv" 2> "$R/ncu8.err" || { echo "ncu rc $?"; tail -3 "$R/ncu8.err"; }
  echo "### c = 8 DFlash, two batch steps, kernels serialized (us)"
  $PY "$(dirname "$0")/ncu_summary.py" "$R/ncu8.csv" 2>&1 | { head -24; tail -1; }
fi
echo "### done in $((SECONDS - T0)) s"
