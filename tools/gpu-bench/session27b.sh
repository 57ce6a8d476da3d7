#!/usr/bin/env bash
# Session 27's second call (issue 20): (1) the whole of tests/fused_cuda.rs on the small family
# models with graphs for the hybrids and the draft; (2) the family sweep of the dense rows,
# gpt_oss and qwen3_moe (what graphing the draft's block pass changed), qwen3_5 again with
# graphs off (AB_GRAPHS: the dense hybrid now replays), and a per-section GPU profile of a
# qwen3_5_moe decode step (PROFILE; graphs off while profiling).
#   run(command="bash tools/gpu-bench/session27b.sh", carry=[".device", "tools/goldens/wheels"], timeout_s=600)
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=/tmp/s27b
mkdir -p $R
if [ "${TESTS:-1}" = 1 ]; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 150 $PY "$here/families.py" build --models /root/small --small \
    --device cuda --dtype bfloat16 > $R/small.log 2>&1 || echo "small models: rc $?"
  DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-200} /tmp/stash/fused_cuda --test-threads=1 --nocapture \
    > $R/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
  echo "### tests ($((SECONDS - T0)) s)"
  grep -E "^test |test result|panicked" $R/tests.txt | cut -c1-160 | head -40
  grep -A12 "panicked" $R/tests.txt | head -40
fi
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${FAMILIES:-qwen3 qwen3_5 gpt_oss qwen3_moe qwen3_5_moe}" \
  AB_GRAPHS="${AB_GRAPHS:-qwen3_5}" PROFILE="${PROFILE:-qwen3_5_moe}" \
  DEADLINE=${DEADLINE:-380} OUT= bash "$here/families.sh" 2>&1 | tail -42
tar czf ${OUT:-/tmp}/s27b.tgz -C /tmp s27b
echo "done in $((SECONDS - T0)) s"
