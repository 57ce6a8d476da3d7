#!/usr/bin/env bash
# Session 43, after staging the demo GGUF and dflash (tools/gpu-bench/stage.sh): the demo on
# CUDA with Q4_1 matrices the affine kernels refuse (width 576) now dense. Shows the load
# report, `generate --compare` (greedy DFlash == plain, speedup), held-out tau / speedup /
# greedy mismatches of the committed demo draft at blocks 16 and 8, and batched generation's
# rate (`train --data-only`, 128 sequences at once). Env: GEN_SECS (60), LIMIT (10).
set -uo pipefail
. "$(dirname "$0")/demo-env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
echo "== generate --compare (block 16, then the adaptive policy)"
for bs in "--block-size 16" ""; do
  # shellcheck disable=SC2086
  "$BIN" generate --model "$GGUF" --device cuda --prompt "Write a Python function that returns the sum of a list." \
    --max-tokens 128 --compare $bs 2>&1 >/dev/null | grep -E "^weights|\[dflash\]|\[compare\]|rror" | cut -c1-400
done
echo "== held-out eval of the committed demo draft"
GGUF=$GGUF BIN=$BIN OUT=/root/work/s43-eval LIMIT=${LIMIT:-10} REPEAT=1 BENCH=1 DRAFTS=models/smollm2-135m-dflash \
  ROWS="t0-b16 t0-b8" bash tools/eval-demo/gpu.sh 2>&1 | grep -E "^\||machine" | tail -8
echo "== batched generation, 128 at once, ${GEN_SECS:-60} s"
GEN_SECS=${GEN_SECS:-60} T1_PASSES=0 GEN_BATCH=128 BIN=$BIN GGUF=$GGUF OUT=$R PHASE=gen \
  bash tools/gpu-bench/demo-train.sh 2>&1 | tail -2
head -1 "$R/gen-t0.log"
