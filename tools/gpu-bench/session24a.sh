#!/usr/bin/env bash
# Session 24's first call after promoting route_union (issue 20): (1) tests/fused_cuda.rs as
# the defaults now stand (route_union on, cudarc's per-buffer events off); (2) per family
# (qwen3_moe, qwen3): `dflash bench --micro` Q=1,16 with DFLASH_CUDA_EVENTS=1 (the old
# behaviour) and without, alternating: wall, GPU only, host enqueue; (3) where the host's
# time goes at Q=1, if `perf` is on the machine (flat profile by library and symbol; the
# binary keeps its symbol table).
#   run(command="tools/gpu-bench/session24a.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/s24a
M=/dev/shm/fam-models
mkdir -p "$RES" "$M"
echo "tools: perf=$(command -v perf || echo none) nsys=$(command -v nsys || ls /opt/nvidia/nsight-systems*/bin/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -1 || echo none)"
if [ "${TESTS:-1}" = 1 ]; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 150 $PY "$here/families.py" build --models /root/small --small \
    --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
  DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-200} /tmp/stash/fused_cuda --test-threads=1 --nocapture \
    moe attention verify_rows every_family forward_batch batched_attention mma_rows > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
  echo "### tests ($((SECONDS - T0)) s)"
  grep -E "^test |test result|panicked|families," "$RES/tests.txt" | cut -c1-120 | head -20
  grep -A6 "panicked" "$RES/tests.txt" | head -20
fi
for fam in ${FAMS:-qwen3_moe qwen3}; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-380} ] && { echo "$fam skipped (deadline)"; continue; }
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > /tmp/$fam-build.log 2>&1 || { echo "$fam build failed"; tail -3 /tmp/$fam-build.log; continue; }
  common=(bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 --micro-context 128)
  for r in 1 0 1 0; do
    DFLASH_CUDA_EVENTS=$r timeout 90 /tmp/stash/dflash "${common[@]}" --micro-q 1,16 --micro-iters 20 > /tmp/$fam-micro.out 2> /tmp/$fam-micro.err || tail -3 /tmp/$fam-micro.err
    echo "### $fam events=$r ($((SECONDS - T0)) s)"; grep -E '^\| verify (forward )?Q=' /tmp/$fam-micro.out | cut -d'|' -f2,5 | tr '\n' ';'; echo
  done
  if command -v perf > /dev/null; then
    perf record -F 4999 -o /tmp/$fam.perf /tmp/stash/dflash "${common[@]}" --micro-q 1 --micro-iters 300 > /dev/null 2> /tmp/$fam-perf.err || tail -3 /tmp/$fam-perf.err
    echo "### $fam host profile (Q=1, whole process incl. load)"
    perf report -i /tmp/$fam.perf --stdio --no-children --sort dso 2>/dev/null | grep -E "^ +[0-9]" | head -8
    perf report -i /tmp/$fam.perf --stdio --no-children --sort dso,symbol 2>/dev/null | grep -E "^ +[0-9]" | cut -c1-150 | head -40
  fi
  rm -rf "$M/$fam"
done
echo "done in $((SECONDS - T0)) s"
