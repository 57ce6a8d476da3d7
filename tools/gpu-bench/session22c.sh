#!/usr/bin/env bash
# Written in session 22 for its third H200 call, which was not lent: run it first next time.
# The trial kernels of session 22 (switches::Trial, on with DFLASH_TRY=all): the tensor-core
# MoE expert kernels, attention blocks sized to fill the GPU, bf16 router logits read as they
# are. (1) tests/fused_cuda.rs with DFLASH_TRY=all:
# the MoE block of every family's kind against host routing + rows invariant, every attention
# variant against the portable path, verify == decode bit for bit, every family's small model
# (fused vs portable, rollbacks, greedy DFlash == plain), batched == alone. (2) per family
# (qwen3_moe, gpt_oss, qwen3): `dflash bench --micro` (wall) without and with DFLASH_TRY=all,
# alternating, and the ncu kernel table at q 1 / 16 with it, as session22b.sh (whose output,
# docs/perf.md session 22, is the before: same models, same commands).
#   run(command="tools/gpu-bench/session22c.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/s22c
M=/dev/shm/fam-models
mkdir -p "$RES" "$M"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ "${TESTS:-1}" = 1 ]; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
    --device cuda --dtype bfloat16 > "$RES/small.log" 2>&1 || echo "small models: rc $?"
  DFLASH_TRY=all DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-240} /tmp/stash/fused_cuda --test-threads=1 --nocapture \
    moe attention verify_rows every_family forward_batch batched_attention mma_rows > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
  echo "### tests ($((SECONDS - T0)) s)"
  grep -E "^test |test result|panicked|families," "$RES/tests.txt" | cut -c1-200 | head -30
  grep -E "^ok moe" "$RES/tests.txt" | awk '{printf "%s %s %s %s | ", $3, $4, $5, $NF} END {print ""}'
  grep -A6 "panicked" "$RES/tests.txt" | head -30
fi
for fam in ${FAMS:-qwen3_moe gpt_oss qwen3}; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-430} ] && { echo "$fam skipped (deadline)"; continue; }
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > "$RES/$fam-build.log" 2>&1 || { echo "$fam build failed"; tail -3 "$RES/$fam-build.log"; continue; }
  common=(bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 --micro-context 128)
  for r in off all off all; do
    DFLASH_TRY=${r/off/} timeout 60 /tmp/stash/dflash "${common[@]}" --micro-q 1,4,8,16 --micro-iters 20 > "$RES/$fam-micro-$r.out" 2> "$RES/$fam-micro-$r.err" || tail -3 "$RES/$fam-micro-$r.err"
    echo "### $fam wall, try=$r ($((SECONDS - T0)) s)"; grep -E '^\| (verify|draft)' "$RES/$fam-micro-$r.out" | cut -d'|' -f2,5 | tr '\n' ';'; echo
  done
  for q in 1 16; do
    DFLASH_TRY=all DFLASH_PROFILE=ncu timeout 60 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      /tmp/stash/dflash "${common[@]}" --micro-q $q --micro-iters 2 > "$RES/$fam-q$q.csv" 2> "$RES/$fam-q$q.err" \
      || { echo "$fam q$q ncu rc $?"; tail -2 "$RES/$fam-q$q.err"; }
    echo "### $fam q=$q (2 forwards, ns)"; $PY "$here/ncu_summary.py" "$RES/$fam-q$q.csv" | head -14
  done
  rm -rf "$M/$fam"
done
echo "done in $((SECONDS - T0)) s"
