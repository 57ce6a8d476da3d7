#!/usr/bin/env bash
# Session 30, third call (issue 20): the family sweep of qwen3_next (with the `shared` trial A/B),
# then gpt_oss, gemma4 and deepseek_v3 (the Kimi-width MLA layer) as far as the time allows.
#   run(command="bash tools/gpu-bench/session30c.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s30c
mkdir -p "$R"
sweep() {  # sweep FAMILY "TRIAL SETS" (empty: no A/B)
  local fam=$1 tries=$2
  left=$((${BUDGET:-420} - (SECONDS - T0)))
  [ $left -lt 90 ] && { echo "$fam: skipped, ${left}s left"; return; }
  RES=/tmp/s30c-$fam BIN=/tmp/stash/dflash FAMILIES="$fam" AB_TRY="${tries:+$fam}" TRY="$tries" \
    DEADLINE=$((left - 70)) FAM_TIMEOUT=90 OUT= bash "$here/families.sh" > "$R/sweep-$fam.log" 2>&1
  grep -E "^\[ *[0-9]+s\] $fam|^\| $fam" "$R/sweep-$fam.log" | cut -c1-330
}
sweep qwen3_next "shared"
sweep gpt_oss ""
sweep gemma4 ""
sweep deepseek_v3 ""
echo "done in $((SECONDS - T0)) s"
