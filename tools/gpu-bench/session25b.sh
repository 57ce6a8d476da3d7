#!/usr/bin/env bash
# Session 25's second call: (1) tests/fused_cuda.rs with DFLASH_TRY=dflash2_fuse: the DFlash2
# tests (the fused conv + add + norm and the device walk against what they replace, a DFlash2
# draft on the device lossless), the GGUF-as-affine tests (issue 21: every mapped block type
# against the dequantized weights, rows alone == in 16, a tiny GGUF model verify == decode and
# greedy DFlash == plain), and the MLX affine tests again; (2) where a DFlash2 proposal's time
# goes at the Qwen3-8B shape: DFLASH_PROFILE=gpu sections of the DFlash and DFlash2 drafts, and
# ncu kernel tables of both proposals (trial on).
#   run(command="tools/gpu-bench/session25b.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/s25b
M=/root/gpu-bench-models
mkdir -p "$RES" "$M"
DFLASH_TRY=dflash2_fuse timeout ${TEST_LIMIT:-200} /tmp/stash/fused_cuda --test-threads=1 --nocapture dflash2 gguf_ affine \
  mlx_checkpoint > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
echo "### tests, trial on ($((SECONDS - T0)) s)"
grep -E "^test |test result|panicked|selector walk|generations" "$RES/tests.txt" | cut -c1-160 | head -20
grep -A8 "panicked" "$RES/tests.txt" | head -30
ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; }
$PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" > /dev/null 2>&1 || echo "make_dflash2 failed"
echo "### models ($((SECONDS - T0)) s)"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1)
for d in draft-agree draft2; do
  DFLASH_TRY=dflash2_fuse DFLASH_PROFILE=gpu timeout 120 /tmp/stash/dflash "${common[@]}" --micro-iters 20 --draft "$M/$d" \
    --out "$RES/p-$d" > "$RES/p-$d.log" 2>&1 || { echo "profile $d rc $?"; tail -3 "$RES/p-$d.log"; }
  echo "### sections $d (ms, median; trial on)"
  grep -h "^| draft forward Q=" "$RES/p-$d/micro.md" | cut -d'|' -f2,5
  $PY "$here/profile_sections.py" "$RES/p-$d.log" 9 3 | grep draft
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  for d in draft2 draft-agree; do
    DFLASH_TRY=dflash2_fuse DFLASH_PROFILE=ncu-draft timeout 120 "$NCU" --profile-from-start off --clock-control none \
      --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/dflash "${common[@]}" --micro-iters 2 \
      --draft "$M/$d" --out "$RES/ncu-$d" > "$RES/ncu-$d.csv" 2> "$RES/ncu-$d.err" || { echo "ncu rc $?"; tail -2 "$RES/ncu-$d.err"; }
    echo "### ncu $d proposal, trial on (2 proposals, us)"
    $PY "$here/ncu_summary.py" "$RES/ncu-$d.csv" 2>/dev/null | { head -24; tail -1; }
  done
fi
tar czf "${OUT:-/tmp}/s25b.tgz" -C "${OUT:-/tmp}" s25b 2>/dev/null
echo "done in $((SECONDS - T0)) s"
