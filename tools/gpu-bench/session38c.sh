#!/usr/bin/env bash
# Session 38, one call for what 38a and 38b do (when one start is all there is): this
# session's fused_cuda tests (the affine-expert bound, batch choices == alone, the batched /
# verify == decode invariants), then issue 23 on this session's build alone (no A/B: the base
# binary does not fit the carry with fused_cuda): Qwen3-8B shape, controlled-acceptance draft,
# T = 1, c = 1 / 8 / 32 plain and DFlash block 8, and where a c = 32 DFlash cycle goes
# (`DFLASH_PROFILE=1` wall per section, `gpu` kernel time per section).
#   run(command="bash tools/gpu-bench/session38c.sh", carry=[".device/fused_cuda.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda concurrency
begin_session s38c
qwen3_models &
mk=$!
fused_tests tests ${TEST_LIMIT:-170} ${TESTS:-affine_experts batch_choices device_sampler forward_batch batched_attention verify_rows int4_moe}
wait $mk
echo "### tests + models in $((SECONDS - T0)) s"
args="$CONC_ARGS"
timeout 120 /tmp/stash/concurrency $args --block 8 --concurrency 1,8,32 --modes plain,dflash > "$R/block8.md" 2> "$R/block8.err"
echo "### block 8 ($((SECONDS - T0)) s)"; grep -E '^\| (plain|dflash)' "$R/block8.md"
for p in 1 gpu; do
  [ $((SECONDS - T0)) -gt 520 ] && break
  DFLASH_PROFILE=$p timeout 45 /tmp/stash/concurrency $args --block 8 --concurrency 32 --modes dflash > "$R/prof-$p.md" 2> "$R/prof-$p.err"
  echo "### DFLASH_PROFILE=$p, c=32 block 8, mean ms per batch step with a verify: $(batch_step_profile "$R/prof-$p.err")"
done
echo "### done in $((SECONDS - T0)) s"
