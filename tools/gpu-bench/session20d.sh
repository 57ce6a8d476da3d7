#!/usr/bin/env bash
# Fourth H200 call of session 20: where a batched DFlash step spends its GPU time at c=8,
# and aggregate tok/s by fixed block size (4, 8, 16) at c=1, 8, 32.
set -uo pipefail
. "$(dirname "$0")/env.sh" concurrency
RES=${OUT:-/tmp}/s20d
M=/root/s20-models
mkdir -p "$RES" "$M"
ensure_models "$M"
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
DFLASH_PROFILE=gpu timeout 100 $C --block 16 --concurrency 8 --max-tokens 64 --modes dflash > "$RES/prof.md" 2> "$RES/prof.err"
for b in ${BLOCKS:-4 8 16}; do
  timeout 150 $C --block $b --concurrency 1,8,32 --max-tokens 128 --modes dflash > "$RES/block$b.md" 2> "$RES/block$b.err" || tail -3 "$RES/block$b.err"
done
timeout 120 $C --block 16 --concurrency 8 --max-tokens 64 --modes dflash --check > "$RES/check.md" 2> "$RES/check.err"
echo "### check"; tail -n 2 "$RES/check.md"
echo "### profile c=8 dflash block 16 (GPU time)"; $PY "$here/profile_summary.py" "$RES/prof.err" 5
for b in 4 8 16; do echo "### block $b"; grep -E '^\| dflash' "$RES/block$b.md"; done
