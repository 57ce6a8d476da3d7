#!/usr/bin/env bash
# Session 39's trials, for the next call (issue 23): `widen_logits` (the heads' logits widened
# by one vectorized kernel) and `attn_mma` (the attention's (row, head) pairs on the tensor
# cores), plus the batch's verify logits taken whole by the choice (default, untested on a GPU).
# (1) tests: bf16_to_f32, batch choices with batch parts, the draft's and the target's batched
# passes, the attn_mma trial (candle bound, batched == alone, verify == decode), and the default
# attention kernels again (their q preparation and segment decoding became shared device
# functions this session, not yet run on a GPU); (2) issue 23's
# table, Qwen3-8B shape, controlled-acceptance draft, T = 1, block 8, c = 1 / 8 / 32, plain and
# DFlash, DFLASH_TRY = none / widen_logits / widen_logits,attn_mma alternating, two rounds.
# Ran in session 41 with the binaries of d6ce420 (docs/perf.md, session 41); both trials were
# promoted after it, so on later builds DFLASH_TRY names nothing here (session41a.sh is the
# promoted build's run).
# TABLE_LIMIT=S stops the table at S seconds (default 520; e.g. 240 for a short call).
#   run(command="bash tools/gpu-bench/session39f.sh", carry=[".device/fused_cuda.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda concurrency
begin_session s39f
tests_and_models tests 240 bf16_to_f32 batch_choices draft_batch forward_batch attn_mma_trial attention_layer batched_attention verify_rows
echo "### tests + models in $((SECONDS - T0)) s"
DFLASH_TRY=widen_logits,attn_mma timeout 120 /tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda \
  --dtype bf16 --prompt-len 128 --max-tokens 64 --block 8 --concurrency 8 --modes plain,dflash --check > "$R/check.md" 2> "$R/check.err"
echo "### both trials, greedy c = 8: $(grep -h greedy "$R/check.md" | tr '\n' ' ')"
args="$CONC_ARGS --block 8 --concurrency 1,8,32 --modes plain,dflash"
for round in 1 2; do
  for try in none widen_logits widen_logits,attn_mma; do
    [ $((SECONDS - T0)) -gt ${TABLE_LIMIT:-520} ] && break
    DFLASH_TRY=$try timeout 90 /tmp/stash/concurrency $args > "$R/block8-$try-$round.md" 2> "$R/block8-$try-$round.err"
    echo "### DFLASH_TRY=$try round $round ($((SECONDS - T0)) s)"; grep -E '^\| (plain|dflash)' "$R/block8-$try-$round.md"
  done
done
echo "### done in $((SECONDS - T0)) s"
