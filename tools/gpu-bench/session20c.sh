#!/usr/bin/env bash
# Third H200 call of session 20: the batched attention (one K/V write + one attention launch
# for every sequence) tests, then concurrency 1 / 8 / 32 for plain and DFlash (controlled-
# acceptance draft, T=1) with greedy batched == alone, and a GPU-time profile at c=8.
set -uo pipefail
. "$(dirname "$0")/env.sh" dflash fused_cuda concurrency
RES=${OUT:-/tmp}/s20c
M=/root/s20-models
mkdir -p "$RES" "$M"
timeout 200 /tmp/stash/fused_cuda --test-threads 1 batched_attention forward_batch attention_layer 2>&1 | grep -E "^test |test result|panicked|assert|left|right" | head -30 > "$RES/fused.txt"
ensure_models "$M"
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0 --block 16"
timeout 300 $C --concurrency 1,8,32 --max-tokens 128 --check > "$RES/concurrency.md" 2> "$RES/concurrency.err" || tail -5 "$RES/concurrency.err"
DFLASH_PROFILE=gpu timeout 100 $C --concurrency 8 --max-tokens 48 --modes plain > "$RES/prof.md" 2> "$RES/prof.err"
echo "### fused_cuda"; cat "$RES/fused.txt"
echo "### concurrency"; cat "$RES/concurrency.md"
echo "### profile c=8 plain (GPU time)"; $PY "$here/profile_summary.py" "$RES/prof.err" 5
