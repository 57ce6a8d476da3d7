#!/usr/bin/env bash
# Next session's first call (not run yet; written in session 31). Session 31 promoted two
# kernels after running them only as trials (DFLASH_TRY): the 16-warp blocking for weights of
# at most 128 tiles (it also changes the MoE routers and the 2,048-wide projections of the MoE
# rows) and the DFlash2 convolving epilogues. (1) tests/fused_cuda.rs on the promoted build (the
# skinny GEMM at every blocking, both epilogues, the DFlash2 draft, every family's greedy DFlash
# == plain, graphs == eager); (2) the family sweep of the MoE rows the narrow blocking touches,
# to set beside session 30's (docs/perf.md): qwen3_moe, qwen3_5_moe, gpt_oss, as far as the
# time allows.
#   run(command="BUDGET=560 bash tools/gpu-bench/session32a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s32a
mkdir -p "$R"
fused_tests tests "${TEST_LIMIT:-200}"
echo "### tests done in $((SECONDS - T0)) s"
sweep qwen3_moe "" FAM_TIMEOUT=90
sweep qwen3_5_moe "" FAM_TIMEOUT=90
sweep gpt_oss "" FAM_TIMEOUT=90
echo "done in $((SECONDS - T0)) s"
