#!/usr/bin/env bash
# Session 39 (issue 23): a batch's host work per layer, A/B in one run: `concurrency_base`
# (40b89c1) against `concurrency` (this session's build: the batch's rope tables made once a
# forward and read whole by the batched kernels instead of concatenated per layer; the draft's
# context keys/values of every sequence in one launch a layer; the rows for the LM heads
# gathered in one op). Qwen3-8B shape, controlled-acceptance draft, T = 1, prompts of 128,
# 128 new tokens, c = 1 / 8 / 32, plain and DFlash block 8, builds alternating; then where a
# c = 32 step goes (`DFLASH_PROFILE=gpu`), both builds, DFlash and plain.
#   run(command="bash tools/gpu-bench/session39b.sh", carry=[".device/concurrency_base.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" concurrency_base concurrency
begin_session s39b
qwen3_models
echo "### models in $((SECONDS - T0)) s"
args="$CONC_ARGS"
for b in concurrency_base concurrency concurrency_base concurrency; do
  [ $((SECONDS - T0)) -gt 300 ] && break
  timeout 120 /tmp/stash/$b $args --block 8 --concurrency 1,8,32 --modes plain,dflash > "$R/block8-$b.md" 2> "$R/block8-$b.err"
  echo "### $b block 8 ($((SECONDS - T0)) s)"; grep -E '^\| (plain|dflash)' "$R/block8-$b.md"
done
for b in concurrency_base concurrency; do
  for m in dflash plain; do
    [ $((SECONDS - T0)) -gt 480 ] && break
    DFLASH_PROFILE=gpu timeout 45 /tmp/stash/$b $args --block 8 --concurrency 32 --modes $m > "$R/prof-$m-$b.md" 2> "$R/prof-$m-$b.err"
    echo "### $b $m c=32, mean ms per batch step (gpu): $(batch_step_profile "$R/prof-$m-$b.err")"
  done
done
echo "### done in $((SECONDS - T0)) s"
