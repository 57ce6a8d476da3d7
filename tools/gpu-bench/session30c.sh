#!/usr/bin/env bash
# Session 30, third call (issue 20): the family sweep of qwen3_next, gemma4 and deepseek_v3
# (the Kimi-width MLA layer), with the trials A/B where they apply.
#   run(command="bash tools/gpu-bench/session30c.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s30c
mkdir -p "$R"
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${SWEEP:-qwen3_next gemma4 deepseek_v3}" AB_TRY="${AB:-qwen3_next gemma4}" \
  TRY="${TRY:-prefetch,combine}" DEADLINE=$((${BUDGET:-570} - 150)) OUT= bash "$here/families.sh" 2>&1 | tail -24
echo "done in $((SECONDS - T0)) s"
