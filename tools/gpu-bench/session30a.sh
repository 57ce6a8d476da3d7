#!/usr/bin/env bash
# Session 30, first call (issue 20). (1) the whole of tests/fused_cuda.rs (session 29's prefetch
# trial code and session 30's `combine` and `shared` trials, all off by default; the MoE test checks
# `combine` against `moe_combine` bit for bit and `shared` against the separate MLP); (2) the tests that capture graphs, batch and run
# the draft again with DFLASH_TRY=all (prefetch, combine, shared); (3) the family sweep of qwen3_moe with the
# trials A/B (default, prefetch, combine, both, default again) in the same run.
#   run(command="bash tools/gpu-bench/session30a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s30a
mkdir -p "$R"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || { echo "small models: rc $?"; tail -5 /tmp/small.log; }
DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-220} /tmp/stash/fused_cuda --test-threads=1 --nocapture > /tmp/tests.txt 2>&1 \
  || echo "!! fused_cuda rc $?"
grep -E "test result|panicked|FAILED|failed" /tmp/tests.txt | cut -c1-150 | head -20
grep -cE "^test .* ok$" /tmp/tests.txt
grep -A8 "panicked" /tmp/tests.txt | head -24
echo "### default tests done in $((SECONDS - T0)) s"
DFLASH_TRY=all DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads=1 --nocapture \
  graphs verify_rows every_family dflash2_draft batched > /tmp/tests-pf.txt 2>&1 || echo "!! fused_cuda (trials) rc $?"
grep -E "^test |test result|panicked" /tmp/tests-pf.txt | cut -c1-150 | head -20
grep -A8 "panicked" /tmp/tests-pf.txt | head -16
cp /tmp/tests.txt /tmp/tests-pf.txt "$R/" 2>/dev/null
echo "### trial tests done in $((SECONDS - T0)) s"
left=$((${BUDGET:-570} - (SECONDS - T0)))
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${SWEEP:-qwen3_moe}" AB_TRY="${AB:-qwen3_moe}" TRY="prefetch combine prefetch,combine" \
  DEADLINE=$((left - 120)) OUT= bash "$here/families.sh" 2>&1 | tail -16
echo "done in $((SECONDS - T0)) s"
