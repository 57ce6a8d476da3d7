#!/usr/bin/env bash
# Session 30, second call (issue 20): the family sweep of qwen3, gpt_oss and qwen3_5_moe, each
# with the trials A/B (default, TRY..., default again) in the same run; qwen3 also with the
# batch-invariant kernels off (their cost, issue 20 item 3).
#   run(command="bash tools/gpu-bench/session30b.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s30b
mkdir -p "$R"
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${SWEEP:-qwen3 gpt_oss qwen3_5_moe}" AB_TRY="${AB:-qwen3 gpt_oss qwen3_5_moe}" \
  TRY="${TRY:-prefetch,combine}" AB_INVARIANT="${ABI:-qwen3}" DEADLINE=$((${BUDGET:-570} - 150)) OUT= bash "$here/families.sh" 2>&1 | tail -24
echo "done in $((SECONDS - T0)) s"
