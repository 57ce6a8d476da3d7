#!/usr/bin/env bash
# Session 26's third call: (1) the whole tests/fused_cuda.rs with the defaults as committed
# (CUDA graphs on: every test whose model is all attention layers now decodes and verifies
# through graphs, the MLX and GGUF checkpoint tests included) on the small family models;
# (2) with FAMILIES="qwen3_5 deepseek_v3 gemma4" (say), those rows of the family sweep.
#   run(command="bash tools/gpu-bench/session26c.sh", carry=[".device", "tools/goldens/wheels"], timeout_s=600)
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda
R=/tmp/s26c
mkdir -p $R
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 150 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-240} /tmp/stash/fused_cuda --test-threads=1 --nocapture > $R/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
echo "### tests ($((SECONDS - T0)) s)"
grep -E "^test |test result|panicked|families,|GraphReport|generations" $R/tests.txt | cut -c1-160 | head -50
grep -A10 "panicked" $R/tests.txt | head -40
if [ -n "${FAMILIES:-}" ]; then
  RES=$R/families FAMILIES="$FAMILIES" DEADLINE=${DEADLINE:-$((360 - (SECONDS - T0)))} OUT= bash "$here/families.sh"
fi
tar czf ${OUT:-/tmp}/s26c.tgz -C /tmp s26c
echo "done in $((SECONDS - T0)) s"
