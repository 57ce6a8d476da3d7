#!/usr/bin/env bash
# Session 41: the promoted build (issue 23). `widen_logits` is the default and the tensor-core
# attention runs for launches of more than 16 rows (DFLASH_ATTN_MMA=auto). (1) tests: the
# tensor-core attention forced on for every case and the auto policy, bf16_to_f32, verify rows,
# the batched passes and choices; (2) greedy c = 8 batched == alone, plain and DFlash (issue 23
# item 2); (3) issue 23's table (Qwen3-8B shape, controlled-acceptance draft, T = 1, block 8,
# c = 1 / 8 / 32, plain and DFlash), DFLASH_ATTN_MMA = auto / 0 alternating, two rounds.
# TABLE_LIMIT=S stops the table at S seconds (default 400).
#   run(command="bash tools/gpu-bench/session41a.sh", carry=[".device/fused_cuda.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda concurrency
begin_session s41a
tests_and_models tests 240 attn_mma bf16_to_f32 verify_rows batched_attention attention_layer forward_batch draft_batch batch_choices
grep -h "attn_mma:" /tmp/tests.txt
echo "### tests + models in $((SECONDS - T0)) s"
timeout 120 /tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda \
  --dtype bf16 --prompt-len 128 --max-tokens 64 --block 8 --concurrency 8 --modes plain,dflash --check > "$R/check.md" 2> "$R/check.err"
echo "### greedy c = 8: $(grep -h greedy "$R/check.md" | tr '\n' ' ')"
args="$CONC_ARGS --block 8 --concurrency 1,8,32 --modes plain,dflash"
for round in 1 2; do
  for mma in auto 0; do
    [ $((SECONDS - T0)) -gt ${TABLE_LIMIT:-400} ] && break
    DFLASH_ATTN_MMA=$mma timeout 90 /tmp/stash/concurrency $args > "$R/block8-mma$mma-$round.md" 2> "$R/block8-mma$mma-$round.err"
    echo "### DFLASH_ATTN_MMA=$mma round $round ($((SECONDS - T0)) s)"; grep -E '^\| (plain|dflash)|^switches' "$R/block8-mma$mma-$round.md" | cut -c1-220
  done
done
echo "### done in $((SECONDS - T0)) s"
