#!/usr/bin/env bash
# Session 39, last call: the logits' widening in one vectorized kernel and the batch's verify
# logits taken whole by the choice (tests: bf16_to_f32, batch choices with batch parts, the
# draft's and the target's batched passes), then issue 23's table on this build (Qwen3-8B shape,
# controlled-acceptance draft, T = 1, block 8, c = 1 / 8 / 32, plain and DFlash).
#   run(command="bash tools/gpu-bench/session39f.sh", carry=[".device/fused_cuda.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda concurrency
R=${OUT:-/tmp}/s39f
mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=/root/s20-models
mkdir -p $M
ensure_models "$M" &
mk=$!
fused_tests tests 100 bf16_to_f32 batch_choices draft_batch forward_batch
wait $mk || { echo "models failed"; tail -5 "$M.log"; }
echo "### tests + models in $((SECONDS - T0)) s"
timeout 90 /tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 \
  --temperature 1.0 --max-tokens 128 --block 8 --concurrency 1,8,32 --modes plain,dflash > "$R/block8.md" 2> "$R/block8.err"
grep -E '^\| (plain|dflash)' "$R/block8.md"
echo "### done in $((SECONDS - T0)) s"
