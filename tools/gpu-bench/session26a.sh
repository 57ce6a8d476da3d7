#!/usr/bin/env bash
# Session 26's first call (issues 20 and 22). (1) The skinny-GEMM lab (skinny/) with the
# cluster split of K for narrow weights (kernels/mma.cu gemm_rows_split) at S = 2/4/8 against
# the production blockings, on the narrow shapes (DFlash2's kernel projection 1024x4096, MoE
# routers, a 30B-A3B o_proj) and the Qwen3-8B ones. (2) tests/fused_cuda.rs with
# DFLASH_TRY=mma_split on the small family models: the skinny GEMM (every blocking incl. the
# splits, rows alone == among 16), the batched attention kernels (they now read device
# positions when given), every family on the fused path, forward_batch, CUDA graphs vs eager
# (graphs_replay_the_eager_forwards), DFlash2. (3) Qwen3-8B shape: the DFlash and the DFlash2
# draft step with mma_split off / on, alternating; then the target's plain step and verify(16)
# with DFLASH_CUDA_GRAPHS off / on, alternating.
#   run(command="bash tools/gpu-bench/session26a.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda skinny
RES=${OUT:-/tmp}/s26a
M=/root/gpu-bench-models
mkdir -p "$RES" "$M"
timeout 120 /tmp/stash/skinny 20 > "$RES/skinny.txt" 2>&1 || echo "!! skinny rc $?"
echo "### skinny lab ($((SECONDS - T0)) s): us per product"
grep -E "^(dyn-k|router|o 2048|kv 1024|q/o|qkv 6144)" "$RES/skinny.txt" | grep -E "prod|split" \
  | awk '{printf "%s %s %s %s %s | ", $1, $2, $3, $4, $(NF-3)} END {print ""}' | tr '|' '\n' | head -70
grep -E "^!!|failures" "$RES/skinny.txt" | head -8
if [ "${TESTS:-1}" = 1 ]; then
  HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 150 $PY "$here/families.py" build --models /root/small --small \
    --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
  DFLASH_TRY=mma_split DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-260} /tmp/stash/fused_cuda --test-threads=1 --nocapture \
    mma graphs batched_attention every_family forward_batch verify_rows dflash2 > "$RES/tests.txt" 2>&1 || echo "!! fused_cuda rc $?"
  echo "### tests ($((SECONDS - T0)) s)"
  grep -E "^test |test result|panicked|families,|GraphReport" "$RES/tests.txt" | cut -c1-160 | head -40
  grep -A10 "panicked" "$RES/tests.txt" | head -40
fi
ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; }
$PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" > /dev/null 2>&1 || echo "make_dflash2 failed"
echo "### models ($((SECONDS - T0)) s)"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-iters 30)
med() { grep -h "^| $2" "$1" | head -n 1 | awk -F'|' '{gsub(/ /,"",$5); print $5}'; }
ratio_round() {  # $1 round, $2 trial
  for d in draft-agree draft2; do
    DFLASH_TRY=$2 timeout 90 /tmp/stash/dflash "${common[@]}" --micro-q 1 --draft "$M/$d" --out "$RES/m-$d-$2-$1" \
      > "$RES/m-$d-$2-$1.log" 2>&1 || { echo "micro $d rc $?"; tail -3 "$RES/m-$d-$2-$1.log"; }
  done
  a=$(med "$RES/m-draft-agree-$2-$1/micro.md" "draft forward Q="); b=$(med "$RES/m-draft2-$2-$1/micro.md" "draft forward Q=")
  r=$($PY -c "print(f'{float(\"$b\")/float(\"$a\"):.3f}')" 2>/dev/null || echo "?")
  echo "| $1 | $2 | ${a:-?} | ${b:-?} | $r |"
}
graphs_run() {  # $1 = 0 / 1
  DFLASH_TRY=mma_split DFLASH_CUDA_GRAPHS=$1 timeout 60 /tmp/stash/dflash "${common[@]}" --micro-q 1,16 --out "$RES/g-$1-$SECONDS" > "$RES/g-$1.log" 2>&1 \
    || { echo "micro graphs=$1 rc $?"; tail -3 "$RES/g-$1.log"; return; }
  f=$(ls -d "$RES"/g-$1-* | tail -1)/micro.md
  echo "graphs=$1 (us): Q=1 wall $(med $f 'verify forward Q=1 '), GPU only $(med $f 'verify Q=1: GPU'), host $(med $f 'verify Q=1: host'); Q=16 wall $(med $f 'verify forward Q=16'), GPU only $(med $f 'verify Q=16: GPU'); $(grep -h 'CUDA graphs' $f)"
}
echo "| round | trial | DFlash draft step (us) | DFlash2 draft step (us) | ratio |"
echo "|---|---|---:|---:|---:|"
ratio_round 1 none
ratio_round 1 mma_split
echo "### Qwen3-8B target, CUDA graphs off / on ($((SECONDS - T0)) s)"
for g in 0 1 0 1; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-450} ] && break
  graphs_run $g
done
for round in 2 3; do
  for t in none mma_split; do
    [ $((SECONDS - T0)) -gt ${DEADLINE2:-520} ] && break 2
    ratio_round $round $t
  done
done
echo "done in $((SECONDS - T0)) s"
