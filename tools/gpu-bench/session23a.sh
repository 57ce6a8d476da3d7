#!/usr/bin/env bash
# Session 23's first trial call: the two trial kernels (switches::Trial, DFLASH_TRY=all:
# route_union = routing + union in one launch, a warp per row; moe_narrow = 8-unit / 16-row
# tensor-core expert tiles at one row). (1) tests/fused_cuda.rs with DFLASH_TRY=all (the MoE
# block against host routing incl. 512 / 256-grouped / 1024 experts, rows alone == in 16;
# attention; verify == decode; every family's small model; batched == alone). (2) per family
# (qwen3_moe, gpt_oss): `dflash bench --micro` off / all alternating, the union the micro
# bench's rows really route to (union.py), and the ncu kernel table at q 1 with the trials on.
#   run(command="tools/gpu-bench/session23a.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/s23a
M=/dev/shm/fam-models
mkdir -p "$RES" "$M"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ "${TESTS:-1}" = 1 ]; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 150 $PY "$here/families.py" build --models /root/small --small \
    --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
  DFLASH_TRY=all DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-200} /tmp/stash/fused_cuda --test-threads=1 --nocapture \
    moe attention verify_rows every_family forward_batch batched_attention mma_rows > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
  echo "### tests ($((SECONDS - T0)) s)"
  grep -E "^test |test result|panicked|families," "$RES/tests.txt" | cut -c1-160 | head -20
  grep -E "^ok moe" "$RES/tests.txt" | awk '{printf "%s %s %s %s | ", $3, $4, $7, $NF} END {print ""}'
  grep -A6 "panicked" "$RES/tests.txt" | head -20
fi
for fam in ${FAMS:-qwen3_moe gpt_oss}; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-400} ] && { echo "$fam skipped (deadline)"; continue; }
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > /tmp/$fam-build.log 2>&1 || { echo "$fam build failed"; tail -3 /tmp/$fam-build.log; continue; }
  common=(bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 --micro-context 128)
  for r in off all off all; do
    DFLASH_TRY=${r/off/} timeout 60 /tmp/stash/dflash "${common[@]}" --micro-q 1,4,8,16 --micro-iters 20 > /tmp/$fam-micro.out 2> /tmp/$fam-micro.err || tail -3 /tmp/$fam-micro.err
    echo "### $fam wall, try=$r ($((SECONDS - T0)) s)"; grep -E '^\| verify forward' /tmp/$fam-micro.out | cut -d'|' -f2,5 | tr '\n' ';'; echo
  done
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 90 $PY "$here/union.py" "$M/$fam/target" 2>&1 | tail -5
  DFLASH_TRY=all DFLASH_PROFILE=ncu timeout 60 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    /tmp/stash/dflash "${common[@]}" --micro-q 1 --micro-iters 2 > /tmp/$fam-q1.csv 2> /tmp/$fam-q1.err \
    || { echo "$fam q1 ncu rc $?"; tail -2 /tmp/$fam-q1.err; }
  echo "### $fam q=1 (2 forwards, ns)"; $PY "$here/ncu_summary.py" /tmp/$fam-q1.csv 2>/dev/null | { head -12; tail -1; }
  rm -rf "$M/$fam"
done
echo "done in $((SECONDS - T0)) s"
