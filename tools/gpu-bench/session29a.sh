#!/usr/bin/env bash
# Written at the end of session 28 and NOT run (its device time was spent): the first call of
# the next session. (1) the whole of tests/fused_cuda.rs at HEAD (session 28 ran the attention /
# mma / graphs / verify / family / batched subsets after its kernel changes, but not the GGUF /
# MLX / DFlash2 tests, and not after the Ffn::load_qwen tidy); (2) the family sweep of the rows
# session 28 did not measure: gpt_oss, qwen3_next, deepseek_v3, gemma4.
#   run(command="bash tools/gpu-bench/session29a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
# (.device/*.xz: strip + xz -9e, see device.sh; both at xz -3 no longer fit a call's 64 MiB.)
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s29a
mkdir -p "$R"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
DFLASH_FAMILY_MODELS=/root/small timeout 220 /tmp/stash/fused_cuda --test-threads=1 --nocapture > /tmp/tests.txt 2>&1 \
  || echo "!! fused_cuda rc $?"
grep -E "^test |test result|panicked" /tmp/tests.txt | cut -c1-150 | head -40
grep -A8 "panicked" /tmp/tests.txt | head -24
echo "### tests done in $((SECONDS - T0)) s"
left=$((560 - (SECONDS - T0)))
RES=$R/families BIN=/tmp/stash/dflash FAMILIES="${SWEEP:-gpt_oss qwen3_next deepseek_v3 gemma4}" DEADLINE=$((left - 120)) \
  OUT= bash "$here/families.sh" 2>&1 | tail -18
echo "done in $((SECONDS - T0)) s"
