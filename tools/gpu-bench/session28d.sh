#!/usr/bin/env bash
# Session 28's last call (issue 20): the attention kernel merging its key splits itself only in
# blocks of 1-2 pairs (decode steps; 8-pair blocks are back to attn_combine and one key group in
# registers), the LM head writing f32 logits. (1) tests/fused_cuda.rs: mma incl. the f32 form,
# attention vs the portable path, verify == decode, graphs == eager, every family, batched ==
# alone; (2) the family sweep of qwen3_moe and qwen3.
#   run(command="bash tools/gpu-bench/session28d.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s28d
mkdir -p "$R"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads=1 --nocapture \
  mma attention verify_rows graphs every_family batched forward_batch > /tmp/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
grep -E "^test |test result|panicked" /tmp/tests.txt | cut -c1-150 | head -30
grep -A8 "panicked" /tmp/tests.txt | head -24
echo "### tests done in $((SECONDS - T0)) s"
left=$((${BUDGET:-450} - (SECONDS - T0)))
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${SWEEP:-qwen3_moe qwen3}" DEADLINE=$((left - 120)) OUT= \
  bash "$here/families.sh" 2>&1 | tail -16
echo "done in $((SECONDS - T0)) s"
