#!/usr/bin/env bash
# Session 41's build on the GPU (issues 23 and 20), one call. `widen_logits` is the default and
# the tensor-core attention runs for launches of more than 16 rows (DFLASH_ATTN_MMA=auto).
# (1) tests: the tensor-core attention forced on for every case and the auto policy,
# bf16_to_f32, verify rows, the batched passes and choices; (2) `dflash bench --concurrency`
# greedy check at c = 8 (batched == alone, plain and DFlash: issue 23 item 2); (3) issue 23's
# table (Qwen3-8B shape, controlled-acceptance draft, T = 1, block 8, c = 1 / 8 / 32, plain and
# DFlash), DFLASH_ATTN_MMA = auto / 0 alternating, two rounds, until TABLE_LIMIT s (default
# 330); (4) issue 20's draft / step at the real depth (36 layers): `bench --micro` verify Q=1 /
# Q=16 and the draft's 16-row proposal, two rounds; (5) with time left (BUDGET s, default 540),
# the draft proposal kernel by kernel under ncu (graphs off, two proposals).
#   run(command="bash tools/gpu-bench/session41a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
begin_session s41a
tests_and_models tests 240 attn_mma bf16_to_f32 verify_rows batched_attention attention_layer forward_batch draft_batch batch_choices
grep -h "attn_mma:" /tmp/tests.txt
echo "### tests + models in $((SECONDS - T0)) s"
pair=(--model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16)
conc=(bench "${pair[@]}" --concurrency-prompt-len 128 --block-size 8)
timeout 120 /tmp/stash/dflash "${conc[@]}" --concurrency 8 --max-tokens 64 --concurrency-check > "$R/check.md" 2> "$R/check.err"
echo "### greedy c = 8: $(grep -h greedy "$R/check.md" | tr '\n' ' ')"
for round in 1 2; do
  for mma in auto 0; do
    [ $((SECONDS - T0)) -gt ${TABLE_LIMIT:-330} ] && break
    DFLASH_ATTN_MMA=$mma timeout 90 /tmp/stash/dflash "${conc[@]}" --concurrency 1,8,32 --max-tokens 128 --temperature 1.0 \
      > "$R/block8-mma$mma-$round.md" 2> "$R/block8-mma$mma-$round.err"
    echo "### DFLASH_ATTN_MMA=$mma round $round ($((SECONDS - T0)) s)"
    grep -E '^\| (plain|dflash)|^switches' "$R/block8-mma$mma-$round.md" | cut -c1-220
  done
done
micro=(bench --micro "${pair[@]}" --micro-context 128)
for round in 1 2; do
  timeout 100 /tmp/stash/dflash "${micro[@]}" --micro-q 1,16 --micro-iters 40 --out "$R/micro-$round" > "$R/micro-$round.log" 2>&1 \
    || { echo "micro rc $?"; tail -3 "$R/micro-$round.log"; }
  echo "### issue 20, Qwen3-8B at 36 layers, micro round $round (us, median)"
  grep -hE "^\| (verify|draft) forward" "$R/micro-$round/micro.md" | cut -d'|' -f2,5
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ $((SECONDS - T0)) -lt $((${BUDGET:-540} - 60)) ]; then
  DFLASH_CUDA_GRAPHS=0 DFLASH_PROFILE=ncu-draft timeout 90 "$NCU" --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/dflash "${micro[@]}" --micro-q 1 --micro-iters 2 \
    --out "$R/ncu-draft" > "$R/ncu-draft.csv" 2> "$R/ncu-draft.err" || { echo "ncu rc $?"; tail -2 "$R/ncu-draft.err"; }
  echo "### the draft's proposal under ncu (2 proposals, us; caches flushed before each kernel)"
  $PY "$here/ncu_summary.py" "$R/ncu-draft.csv" 2>/dev/null | { head -20; tail -1; }
fi
echo "### done in $((SECONDS - T0)) s"
