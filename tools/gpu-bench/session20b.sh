#!/usr/bin/env bash
# Second H200 call of session 20: the DFlash2 tests with the two-stage top-k, DFlash vs
# DFlash2 draft step again, and where a batched plain step spends its time (DFLASH_PROFILE
# sync and gpu) at concurrency 1 and 8. Same binaries / carry as session20.sh.
set -uo pipefail
. "$(dirname "$0")/env.sh" dflash fused_cuda concurrency
RES=${OUT:-/tmp}/s20b
M=/root/s20-models
mkdir -p "$RES" "$M"
timeout 200 /tmp/stash/fused_cuda --test-threads 1 dflash2 2>&1 | grep -E "^test |test result|panicked|rel err" > "$RES/fused.txt"
ensure_models "$M"
[ -d "$M/draft2" ] || $PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" > /dev/null
for d in draft-agree draft2; do
  timeout 120 /tmp/stash/dflash bench --micro --model "$M/target" --draft "$M/$d" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1 --micro-iters 30 --out "$RES/micro-$d" > "$RES/micro-$d.log" 2>&1 || echo "micro $d FAILED"
done
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --max-tokens 48 --prompt-len 128 --temperature 1.0 --block 16"
for c in 1 8; do
  for mode in 1 gpu; do
    DFLASH_PROFILE=$mode timeout 120 $C --concurrency $c --modes plain > "$RES/prof-$c-$mode.md" 2> "$RES/prof-$c-$mode.err"
    DFLASH_PROFILE=$mode timeout 120 $C --concurrency $c --modes dflash > "$RES/profd-$c-$mode.md" 2> "$RES/profd-$c-$mode.err"
  done
done
echo "### fused_cuda dflash2"; cat "$RES/fused.txt"
echo "### draft step"
for d in draft-agree draft2; do echo "$d: $(grep -h '^| draft forward Q=' "$RES/micro-$d/micro.md" 2>/dev/null | head -n 1)"; done
for c in 1 8; do for mode in 1 gpu; do for p in prof profd; do
  echo "### $p c=$c DFLASH_PROFILE=$mode: $(grep -E '^\| (plain|dflash)' "$RES/$p-$c-$mode.md" | head -1)"
  $PY "$here/profile_summary.py" "$RES/$p-$c-$mode.err" 5
done; done; done
