#!/usr/bin/env bash
# Second H200 call of session 21: (1) gemma4's small model and five variants with one feature
# changed each (families.py VARIANTS) through the fused path, to locate its difference; (2) the
# batch-level adaptive policy with first-observation minimum, expiry and exploration, against
# fixed blocks 4 / 8 / 16 and plain, one run.
set -uo pipefail
. "$(dirname "$0")/env.sh" fused_cuda concurrency
RES=${OUT:-/tmp}/s21b
M=/root/s20-models
mkdir -p "$RES" "$M"
G=gemma4,gemma4-noshare,gemma4-nokeqv,gemma4-global256,gemma4-wide-window,gemma4-nople-nomoe
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build \
  --models /root/g4 --small --only $G --device cuda --dtype bfloat16 > "$RES/small.log" 2>&1
DFLASH_FAMILY_MODELS=/root/g4 timeout 150 /tmp/stash/fused_cuda --test-threads 1 --nocapture \
  every_family > "$RES/family.txt" 2>&1
ensure_models "$M"
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
timeout 200 $C --concurrency 1,8,32 --max-tokens 128 --modes plain,dflash --reasons > "$RES/adaptive.md" 2> "$RES/adaptive.err"
for b in 4 8 16; do
  timeout 120 $C --block $b --concurrency 1,8,32 --max-tokens 128 --modes dflash > "$RES/block$b.md" 2> "$RES/block$b.err"
done
timeout 100 $C --concurrency 1,8,32 --max-tokens 128 --modes dflash --reasons > "$RES/adaptive2.md" 2> "$RES/adaptive2.err"
echo "### gemma4 variants"; grep -E "^gemma4|^ok gemma4|gemma4[a-z0-9-]*: fused" "$RES/family.txt" | cut -c1-330
grep -E "BUILD FAILED|Error" "$RES/small.log" | head -5
echo "### adaptive (after plain)"; grep -E '^\| (plain|dflash)' "$RES/adaptive.md"
grep "q histogram" "$RES/adaptive.err" | grep dflash | cut -c1-220
for b in 4 8 16; do echo "### fixed block $b"; grep -E '^\| dflash' "$RES/block$b.md"; done
echo "### adaptive again (dflash only, no plain rows measured first)"; grep -E '^\| dflash' "$RES/adaptive2.md"
grep "q histogram" "$RES/adaptive2.err" | cut -c1-220
