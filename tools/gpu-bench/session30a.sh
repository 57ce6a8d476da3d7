#!/usr/bin/env bash
# Session 30, first call (issue 20). (1) the whole of tests/fused_cuda.rs (session 29's prefetch
# trial code and session 30's `combine` and `shared` trials, all off by default; the MoE test
# checked `combine` against `moe_combine` bit for bit and `shared` against the separate MLP);
# (2) the tests that capture graphs, batch and run the draft again with DFLASH_TRY=all
# (prefetch, combine, shared); (3) the family sweep of qwen3_moe with the trials A/B (default,
# prefetch, combine, both, default again) in the same run.
#   run(command="bash tools/gpu-bench/session30a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s30a
mkdir -p "$R"
fused_tests tests "${TEST_LIMIT:-220}"
echo "### default tests done in $((SECONDS - T0)) s"
DFLASH_TRY=all fused_tests tests-pf 150 graphs verify_rows every_family dflash2_draft batched
echo "### trial tests done in $((SECONDS - T0)) s"
sweep qwen3_moe "${TRY-prefetch combine prefetch,combine}"  # TRY= : no A/B
echo "done in $((SECONDS - T0)) s"
