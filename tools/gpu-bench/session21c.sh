#!/usr/bin/env bash
# Third H200 call of session 21: (1) every family's small model through the fused path (the
# family check now also passes a fused path as close to f32 as the portable one); (2) the
# adaptive policy with costs per (sequences, rows) against fixed blocks 8 and 16, one run.
set -uo pipefail
. "$(dirname "$0")/env.sh" fused_cuda concurrency
RES=${OUT:-/tmp}/s21c
M=/root/s20-models
mkdir -p "$RES" "$M"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build \
  --models /root/small --small --device cuda --dtype bfloat16 > "$RES/small.log" 2>&1
DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads 1 --nocapture \
  every_family > "$RES/family.txt" 2>&1
ensure_models "$M"
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
timeout 200 $C --concurrency 1,8,32 --max-tokens 128 --modes plain,dflash --reasons > "$RES/adaptive.md" 2> "$RES/adaptive.err"
for b in 8 16; do
  timeout 120 $C --block $b --concurrency 1,8,32 --max-tokens 128 --modes dflash > "$RES/block$b.md" 2> "$RES/block$b.err"
done
timeout 100 $C --concurrency 1,8,32 --max-tokens 128 --modes dflash --reasons > "$RES/adaptive2.md" 2> "$RES/adaptive2.err"
echo "### families"; grep -E "^ok |panicked|families|test result|^gemma4" "$RES/family.txt" | cut -c1-260
echo "### adaptive (plain first)"; grep -E '^\| (plain|dflash)' "$RES/adaptive.md"
grep "q histogram" "$RES/adaptive.err" | grep dflash | cut -c1-220
for b in 8 16; do echo "### fixed block $b"; grep -E '^\| dflash' "$RES/block$b.md"; done
echo "### adaptive (dflash only)"; grep -E '^\| dflash' "$RES/adaptive2.md"
grep "q histogram" "$RES/adaptive2.err" | cut -c1-220
