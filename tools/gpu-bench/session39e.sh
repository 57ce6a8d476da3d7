#!/usr/bin/env bash
# Session 39 (issue 23): what a c = 32 batch step is made of, kernel by kernel. Qwen3-8B shape,
# controlled-acceptance draft, T = 1, block 8; `DFLASH_PROFILE=ncu-batch` brackets the 11th and
# 12th batch steps of 8+ sequences, ncu times each kernel (gpu__time_duration, serialized),
# summed by kernel name (ncu_summary.py): DFlash, then plain.
#   run(command="bash tools/gpu-bench/session39e.sh", carry=[".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" concurrency
begin_session s39e
qwen3_models
echo "### models in $((SECONDS - T0)) s"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
args="$CONC_ARGS --block 8 --concurrency 32"
for m in dflash plain; do
  [ $((SECONDS - T0)) -gt 400 ] && break
  DFLASH_PROFILE=ncu-batch timeout 200 "$NCU" --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/concurrency $args --modes $m \
    > "$R/ncu-$m.csv" 2> "$R/ncu-$m.err" || { echo "ncu rc $?"; tail -3 "$R/ncu-$m.err"; }
  echo "### $m c=32 block 8: two batch steps, kernels serialized ($((SECONDS - T0)) s)"
  $PY "$(dirname "$0")/ncu_summary.py" "$R/ncu-$m.csv" 2>&1 | { head -24; tail -1; }
done
echo "### done in $((SECONDS - T0)) s"
