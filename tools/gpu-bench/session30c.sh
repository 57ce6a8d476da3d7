#!/usr/bin/env bash
# Session 30, third call (issue 20): the family sweep of qwen3_next (with the `shared` trial A/B),
# then gpt_oss, gemma4 and deepseek_v3 (the Kimi-width MLA layer) as far as the time allows.
#   run(command="BUDGET=430 bash tools/gpu-bench/session30c.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s30c
mkdir -p "$R"
sweep qwen3_next "shared" FAM_TIMEOUT=90
sweep gpt_oss "" FAM_TIMEOUT=90
sweep gemma4 "" FAM_TIMEOUT=90
sweep deepseek_v3 "" FAM_TIMEOUT=90
echo "done in $((SECONDS - T0)) s"
