#!/usr/bin/env bash
# Session 38 (issue 23), many requests at once on today's build (graphs, merged attention
# splits, f32 head logits: none of them measured at concurrency since session 21), A/B in one
# run: `concurrency_base` (c34f96d) against `concurrency` (this session's build: a batch's
# verify choices in one launch and one read-back per way of choosing, not one per sequence).
# Qwen3-8B shape, controlled-acceptance draft, T = 1, prompts of 128, 128 new tokens,
# c = 1 / 8 / 32, plain and DFlash block 8 (alternating builds), then the adaptive policy (new
# build), then where a c = 32 DFlash cycle goes (`DFLASH_PROFILE=1`: wall
# per section, device synced; `gpu`: kernel time per section), both builds.
#   run(command="bash tools/gpu-bench/session38a.sh", carry=[".device/concurrency_base.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" concurrency_base concurrency
begin_session s38a
qwen3_models
echo "### models in $((SECONDS - T0)) s"
args="$CONC_ARGS"
for b in concurrency_base concurrency concurrency_base concurrency; do
  [ $((SECONDS - T0)) -gt 250 ] && break
  timeout 120 /tmp/stash/$b $args --block 8 --concurrency 1,8,32 --modes plain,dflash > "$R/block8-$b.md" 2> "$R/block8-$b.err"
  echo "### $b block 8 ($((SECONDS - T0)) s)"; grep -E '^\| (plain|dflash)' "$R/block8-$b.md"
done
for b in concurrency_base concurrency; do
  for p in 1 gpu; do
    DFLASH_PROFILE=$p timeout 45 /tmp/stash/$b $args --block 8 --concurrency 32 --modes dflash > "$R/prof-$p-$b.md" 2> "$R/prof-$p-$b.err"
    echo "### $b DFLASH_PROFILE=$p, c=32 block 8, mean ms per batch step with a verify: $(batch_step_profile "$R/prof-$p-$b.err")"
  done
done
if [ $((SECONDS - T0)) -lt 380 ]; then
  timeout 90 /tmp/stash/concurrency $args --concurrency 1,8,32 --modes dflash > "$R/adaptive.md" 2> "$R/adaptive.err"
  echo "### adaptive ($((SECONDS - T0)) s)"; grep -E '^\| dflash' "$R/adaptive.md"
fi
echo "### done in $((SECONDS - T0)) s"
