#!/usr/bin/env bash
# Session 28's second call (issue 20): attention splits merged in the kernel (no attn_combine
# launch) with the next keys' loads in flight, and the LM head writing f32 logits (no cast
# launch). (1) tests/fused_cuda.rs: mma (incl. the f32 form), attention vs the portable path,
# verify == decode, graphs == eager, every family, batched == alone; (2) bench --micro twice,
# qwen3_moe and qwen3_5_moe (Q=1/16, draft), then ncu at Q=1 and of the draft (session28a.sh
# has the same ncu runs of the session-27 binary; both binaries do not fit one call's 64 MiB).
#   run(command="bash tools/gpu-bench/session28b.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s28b
M=/dev/shm/fam-models
mkdir -p "$R" "$M"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
DFLASH_FAMILY_MODELS=/root/small timeout 200 /tmp/stash/fused_cuda --test-threads=1 --nocapture \
  mma attention verify_rows graphs every_family batched forward_batch moe_matches argmax > /tmp/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
grep -E "^test |test result|panicked" /tmp/tests.txt | cut -c1-150 | head -30
grep -A8 "panicked" /tmp/tests.txt | head -24
echo "### tests done in $((SECONDS - T0)) s"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
micro() {  # bin fam round -> the verify / draft medians (us) of micro.md
  local d="$R/$1-$2-$3"
  timeout 100 /tmp/stash/$1 bench --micro --model "$M/$2/target" --draft "$M/$2/draft" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1,16 --micro-iters 20 --out "$d" > "$d.log" 2>&1 || { echo "$1 $2 rc $?"; tail -3 "$d.log"; }
  grep -hE "^\| (verify|draft) forward" "$d/micro.md" | awk -F'|' '{gsub(/ +$/,"",$2); gsub(/ /,"",$5); printf "%s %s; ", $2, $5}'; echo
}
for fam in ${FAMS:-qwen3_moe qwen3_5_moe}; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-420} ] && { echo "$fam skipped (deadline)"; continue; }
  timeout 200 $PY "$here/families.py" build --models "$M" --only "$fam" --device cuda --dtype bfloat16 > "$R/$fam-build.log" 2>&1 || { echo "$fam build failed"; tail -3 "$R/$fam-build.log"; continue; }
  for round in 1 2; do
    echo -n "$fam r$round: "; micro dflash $fam $round
  done
  for what in ncu ncu-draft; do
    q=1; [ $what = ncu-draft ] && q=16
    DFLASH_CUDA_GRAPHS=0 DFLASH_PROFILE=$what timeout 100 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      /tmp/stash/dflash bench --micro --model "$M/$fam/target" --draft "$M/$fam/draft" --device cuda --dtype bf16 \
      --micro-context 128 --micro-q $q --micro-iters 2 > "$R/$fam-$what.csv" 2> "$R/$fam-$what.err" || echo "$fam $what ncu rc $?"
    echo "### $fam $what q=$q (2 calls)"; $PY "$here/ncu_summary.py" "$R/$fam-$what.csv" | grep -E 'attn|cast|gemm_w4u2n2|all' 
  done
  rm -rf "$M/$fam"
done
echo "done in $((SECONDS - T0)) s"
