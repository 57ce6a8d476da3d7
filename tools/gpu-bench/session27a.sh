#!/usr/bin/env bash
# Session 27's first call (issue 20): CUDA graphs for the hybrids (Gated DeltaNet state on the
# cache's device ring) and for the draft's block pass. (1) tests/fused_cuda.rs on the small
# family models: graphs vs eager for every family's target and draft bit for bit (the hybrids
# must replay now), greedy DFlash == plain with graphs, verify rows with rollbacks == decode
# steps, every family on the fused path, forward_batch, DFlash2. (2) the family sweep of the
# hybrid MoE rows, each micro again with graphs off (AB_GRAPHS).
#   run(command="bash tools/gpu-bench/session27a.sh", carry=[".device", "tools/goldens/wheels"], timeout_s=600)
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=/tmp/s27a
mkdir -p $R
if [ "${TESTS:-1}" = 1 ]; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 150 $PY "$here/families.py" build --models /root/small --small \
    --device cuda --dtype bfloat16 > $R/small.log 2>&1 || echo "small models: rc $?"
  echo "### small models ($((SECONDS - T0)) s)"
  DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-240} /tmp/stash/fused_cuda --test-threads=1 --nocapture \
    ${TEST_FILTER:-graphs verify_rows every_family forward_batch dflash2} > $R/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
  echo "### tests ($((SECONDS - T0)) s)"
  grep -E "^test |test result|panicked|GraphReport|families," $R/tests.txt | cut -c1-200 | head -50
  grep -A12 "panicked" $R/tests.txt | head -40
fi
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${FAMILIES:-qwen3_5_moe qwen3_next}" AB_GRAPHS="${AB_GRAPHS:-qwen3_5_moe qwen3_next}" \
  DEADLINE=${DEADLINE:-420} OUT= bash "$here/families.sh" 2>&1 | tail -40
tar czf ${OUT:-/tmp}/s27a.tgz -C /tmp s27a
echo "done in $((SECONDS - T0)) s"
