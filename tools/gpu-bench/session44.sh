#!/usr/bin/env bash
# Session 44, after staging the demo GGUF and dflash (tools/gpu-bench/stage.sh): one call that
# checks the CUDA fallback for the 576-wide Q4_1 matrices (load report, `generate --compare` at
# block 16: greedy DFlash == plain, and plain decoding's rate), then generates the training
# data (PHASE=gen of demo-train.sh: GEN_SECS a pass, T1_PASSES sampled passes, GEN_BATCH).
set -uo pipefail
. "$(dirname "$0")/demo-env.sh"
echo "== generate --compare --block-size 16"
timeout 90 "$BIN" generate --model "$GGUF" --device cuda --max-tokens 128 --compare --block-size 16 \
  --prompt "Write a Python function that checks whether a number is prime." 2>&1 >/dev/null |
  grep -E "^weights|\[dflash\]|\[compare\]|rror" | cut -c1-400
echo "== batched generation: $([ "${GREEDY:-1}" = 0 ] && echo 0 || echo 1) greedy + ${T1_PASSES:-1} sampled passes of ${GEN_SECS:-200} s, ${GEN_BATCH:-128} at once"
GEN_SECS=${GEN_SECS:-200} T1_PASSES=${T1_PASSES:-1} GEN_BATCH=${GEN_BATCH:-128} BIN=$BIN GGUF=$GGUF OUT=$R PHASE=gen \
  bash tools/gpu-bench/demo-train.sh 2>&1 | tail -8
first=$(ls "$R"/gen-*.log 2>/dev/null | head -1)
[ -n "$first" ] && head -2 "$first" | cut -c1-300
