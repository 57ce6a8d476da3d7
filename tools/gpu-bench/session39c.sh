#!/usr/bin/env bash
# Session 39: the batch path's exactness on the device after its host work moved (the batch's
# rope tables made once, the draft's context keys/values in one launch a layer): the
# fused_cuda tests of batched attention (both table forms), the draft's batched pass, the
# target's batched forward, the batch choices, verify == decode; then greedy batched == alone
# at the Qwen3-8B shape, c = 8, plain and DFlash block 8 (`concurrency --check`).
#   run(command="bash tools/gpu-bench/session39c.sh", carry=[".device/fused_cuda.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda concurrency
begin_session s39c
qwen3_models &
mk=$!
fused_tests tests ${TEST_LIMIT:-200} ${TESTS:-batched_attention draft_batch forward_batch batch_choices verify_rows device_sampler dflash2_draft}
wait $mk
echo "### tests + models in $((SECONDS - T0)) s"
timeout 150 /tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 \
  --prompt-len 128 --max-tokens 64 --block 8 --concurrency 8 --modes plain,dflash --check > "$R/check.md" 2> "$R/check.err"
grep -E 'greedy|^\| (plain|dflash)' "$R/check.md"; tail -3 "$R/check.err"
echo "### done in $((SECONDS - T0)) s"
