#!/usr/bin/env bash
# Session 25's third call (issue 22, acceptance 3): the second DFlash2 trial (`DFLASH_TRY=
# dflash2_fuse`: the selector's top-k with a warp-held list, its pair scores in parallel and
# the walk over them on the device) on the H200. (1) tests/fused_cuda.rs `dflash2` tests with
# the trial on (warp-list top-k == host top-k exactly, device walk vs host walk, a DFlash2
# draft on the device greedy == plain); (2) Qwen3-8B shape (models.py + make_dflash2.py,
# published DFlash2 sizes): the DFlash and the DFlash2 draft step, trial off / on alternating,
# 2 rounds; (3) ncu kernel table of the DFlash2 proposal, trial on and off.
#   run(command="tools/gpu-bench/session25c.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/s25c
M=/root/gpu-bench-models
mkdir -p "$RES" "$M"
DFLASH_TRY=dflash2_fuse timeout ${TEST_LIMIT:-150} /tmp/stash/fused_cuda --test-threads=1 --nocapture dflash2 \
  > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
echo "### tests, trial on ($((SECONDS - T0)) s)"
grep -E "^test |test result|panicked|selector walk|generations" "$RES/tests.txt" | cut -c1-150 | head -20
grep -A8 "panicked" "$RES/tests.txt" | head -30
ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; }
$PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" > /dev/null 2>&1 || echo "make_dflash2 failed"
echo "### models ($((SECONDS - T0)) s)"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1)
med() { grep -h "^| draft forward Q=" "$1" | head -n 1 | awk -F'|' '{gsub(/ /,"",$5); print $5}'; }
echo "| round | trial | DFlash draft step (us) | DFlash2 draft step (us) | ratio |"
echo "|---|---|---:|---:|---:|"
for round in 1 2; do
  for try in none dflash2_fuse; do
    for d in draft-agree draft2; do
      DFLASH_TRY=$try timeout 120 /tmp/stash/dflash "${common[@]}" --micro-iters 30 --draft "$M/$d" --out "$RES/m-$d-$try-$round" \
        > "$RES/m-$d-$try-$round.log" 2>&1 || { echo "micro $d $try rc $?"; tail -3 "$RES/m-$d-$try-$round.log"; }
    done
    a=$(med "$RES/m-draft-agree-$try-$round/micro.md"); b=$(med "$RES/m-draft2-$try-$round/micro.md")
    r=$($PY -c "print(f'{float(\"$b\")/float(\"$a\"):.3f}')" 2>/dev/null || echo "?")
    echo "| $round | $try | ${a:-?} | ${b:-?} | $r |"
  done
done
echo "### micro done ($((SECONDS - T0)) s)"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ $((SECONDS - T0)) -lt ${DEADLINE:-430} ]; then
  for try in dflash2_fuse none; do
    DFLASH_TRY=$try DFLASH_PROFILE=ncu-draft timeout 90 "$NCU" --profile-from-start off --clock-control none \
      --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/dflash "${common[@]}" --micro-iters 2 \
      --draft "$M/draft2" --out "$RES/ncu-$try" > "$RES/ncu-$try.csv" 2> "$RES/ncu-$try.err" || { echo "ncu rc $?"; tail -2 "$RES/ncu-$try.err"; }
    echo "### ncu DFlash2 proposal, trial $try (2 proposals, ns)"
    $PY "$here/ncu_summary.py" "$RES/ncu-$try.csv" 2>/dev/null | { head -16; tail -1; }
  done
fi
tar czf "${OUT:-/tmp}/s25c.tgz" -C "${OUT:-/tmp}" s25c 2>/dev/null
echo "done in $((SECONDS - T0)) s"
