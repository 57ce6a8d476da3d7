#!/usr/bin/env bash
# Session 30, second call (issue 20): the family sweep of qwen3_moe, qwen3_5_moe and qwen3, each
# with the trials A/B in the same run (default, each trial set of TRY_<fam>, default again);
# qwen3 also with the batch-invariant kernels off (their cost, issue 20 item 3). The sweep's
# log lines (the A/B figures) and its table are printed; the whole log is $OUT/s30b/sweep.log.
#   run(command="bash tools/gpu-bench/session30b.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s30b
mkdir -p "$R"
sweep() {  # sweep FAMILY "TRIAL SETS" [extra env]
  local fam=$1 tries=$2; shift 2
  left=$((${BUDGET:-570} - (SECONDS - T0)))
  env "$@" RES=/tmp/s30b-$fam BIN=/tmp/stash/dflash FAMILIES="$fam" AB_TRY="$fam" TRY="$tries" \
    DEADLINE=$((left - 100)) OUT= bash "$here/families.sh" > "$R/sweep-$fam.log" 2>&1
  grep -E "^\[ *[0-9]+s\] $fam|^\| $fam" "$R/sweep-$fam.log" | cut -c1-330
}
sweep qwen3_moe "prefetch combine prefetch,combine"
sweep qwen3_5_moe "shared shared,combine all"
sweep qwen3 "prefetch" AB_INVARIANT=qwen3
echo "done in $((SECONDS - T0)) s"
