#!/usr/bin/env bash
# Session 30, second call (issue 20): the family sweep of qwen3_moe, qwen3_5_moe and qwen3, each
# with the trials A/B in the same run (default, each trial set, default again); qwen3 also with
# the batch-invariant kernels off (their cost, issue 20 item 3). The sweep's log lines (the A/B
# figures) and its table are printed; the whole logs are $OUT/s30b/sweep-FAM.log.
#   run(command="bash tools/gpu-bench/session30b.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
R=${OUT:-/tmp}/s30b
mkdir -p "$R"
sweep qwen3_moe "prefetch combine prefetch,combine"
sweep qwen3_5_moe "shared shared,combine all"
sweep qwen3 "prefetch" AB_INVARIANT=qwen3
echo "done in $((SECONDS - T0)) s"
