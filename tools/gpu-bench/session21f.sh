#!/usr/bin/env bash
# Sixth H200 call of session 21: the adaptive policy with per-batch-size costs seeded from the
# nearest size, against fixed blocks 8 and 16, dflash only and plain first, one run.
set -uo pipefail
. "$(dirname "$0")/env.sh" concurrency
RES=${OUT:-/tmp}/s21f
M=/root/s20-models
mkdir -p "$RES" "$M"
ensure_models "$M"
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
timeout 100 $C --concurrency 1,8,32 --max-tokens 128 --modes dflash --reasons > "$RES/adaptive2.md" 2> "$RES/adaptive2.err"
timeout 100 $C --block 8 --concurrency 1,8,32 --max-tokens 128 --modes dflash > "$RES/block8.md" 2> "$RES/block8.err"
timeout 150 $C --concurrency 1,8,32 --max-tokens 128 --modes plain,dflash --reasons > "$RES/adaptive.md" 2> "$RES/adaptive.err"
echo "### adaptive (dflash only)"; grep -E '^\| dflash' "$RES/adaptive2.md"
grep "q histogram" "$RES/adaptive2.err" | cut -c1-220
echo "### fixed block 8"; grep -E '^\| dflash' "$RES/block8.md"
echo "### adaptive (plain first)"; grep -E '^\| (plain|dflash)' "$RES/adaptive.md"
grep "q histogram" "$RES/adaptive.err" | grep dflash | cut -c1-220
