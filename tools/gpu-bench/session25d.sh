#!/usr/bin/env bash
# Session 25's fourth call (issue 22, acceptance 3), slim for the device time left: the
# selector's pair scores one pair a warp, all at once, and the walk's table copied by a whole
# block (trial dflash2_fuse). (1) the DFlash2 tests with the trial on; (2) Qwen3-8B shape: the
# DFlash and the DFlash2 draft step (trial on) alternating, as many rounds as the deadline allows.
#   run(command="bash tools/gpu-bench/session25d.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/s25d
M=/root/gpu-bench-models
mkdir -p "$RES" "$M"
DFLASH_TRY=dflash2_fuse timeout 100 /tmp/stash/fused_cuda --test-threads=1 --nocapture dflash2 > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
echo "### tests, trial on ($((SECONDS - T0)) s)"
grep -E "^test |test result|panicked|selector walk|generations" "$RES/tests.txt" | cut -c1-150 | head -20
grep -A8 "panicked" "$RES/tests.txt" | head -30
ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; }
$PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" > /dev/null 2>&1 || echo "make_dflash2 failed"
echo "### models ($((SECONDS - T0)) s)"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1 --micro-iters 30)
med() { grep -h "^| draft forward Q=" "$1" | head -n 1 | awk -F'|' '{gsub(/ /,"",$5); print $5}'; }
echo "| round | DFlash draft step (us) | DFlash2 draft step, trial on (us) | ratio |"
echo "|---|---:|---:|---:|"
for round in 1 2 3; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-250} ] && break
  for d in draft-agree draft2; do
    DFLASH_TRY=dflash2_fuse timeout 90 /tmp/stash/dflash "${common[@]}" --draft "$M/$d" --out "$RES/m-$d-$round" \
      > "$RES/m-$d-$round.log" 2>&1 || { echo "micro $d rc $?"; tail -3 "$RES/m-$d-$round.log"; }
  done
  a=$(med "$RES/m-draft-agree-$round/micro.md"); b=$(med "$RES/m-draft2-$round/micro.md")
  r=$($PY -c "print(f'{float(\"$b\")/float(\"$a\"):.3f}')" 2>/dev/null || echo "?")
  echo "| $round | ${a:-?} | ${b:-?} | $r |"
done
echo "done in $((SECONDS - T0)) s"
