#!/usr/bin/env bash
# First H200 call of session 21: (1) every family through the fused path again, with the
# small gemma4 model's q/k norm weights at head_dim**-0.25 (families.py unit_qk_scores), and
# each path's error against f32; (2) the batch-level adaptive policy (costs per forward size)
# against the per-sequence one it replaces (concurrency-old: the session-20 build), alternating
# in one run: adaptive at c=1, 8, 32, then fixed block 8 and plain as references.
set -uo pipefail
. "$(dirname "$0")/env.sh" fused_cuda concurrency concurrency-old
RES=${OUT:-/tmp}/s21a
M=/root/s20-models
mkdir -p "$RES" "$M"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build \
  --models /root/small --small --device cuda --dtype bfloat16 > "$RES/small.log" 2>&1
DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads 1 --nocapture \
  every_family > "$RES/family.txt" 2>&1
ensure_models "$M"
for round in 1 2; do
  for b in concurrency-old concurrency; do
    C="/tmp/stash/$b --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
    timeout 150 $C --concurrency 1,8,32 --max-tokens 128 --modes plain,dflash --reasons \
      > "$RES/$b.$round.md" 2> "$RES/$b.$round.err" || tail -3 "$RES/$b.$round.err"
  done
done
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
timeout 120 $C --block 8 --concurrency 1,8,32 --max-tokens 128 --modes dflash > "$RES/block8.md" 2> "$RES/block8.err"
echo "### families"; grep -E "vs f32|^ok |panicked|families|test result" "$RES/family.txt" | cut -c1-400
for round in 1 2; do for b in concurrency-old concurrency; do
  echo "### $b round $round"; grep -E '^\| (plain|dflash)' "$RES/$b.$round.md"
  grep "q histogram" "$RES/$b.$round.err" | sed 's/q histogram \[[0-9, ]*\] //' | cut -c1-160
done; done
echo "### fixed block 8"; grep -E '^\| dflash' "$RES/block8.md"
