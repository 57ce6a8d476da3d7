#!/usr/bin/env bash
# Session 49 (issue 26): where the self-generation's batch step goes. Session 48's greedy
# generation at 256 sequences in flight took ~19 ms a step on the demo target (135M), far above
# its GPU work. A random SmolLM2-135M-width target (models.py --shape smollm2-135m
# --target-only), prompts of 150 random ids, 64 new tokens, plain decoding:
# `bench --concurrency 64,256` (aggregate tok/s), then the batch steps' sections
# (DFLASH_PROFILE=gpu: GPU time; =1: wall time after a sync per section), then two c = 256
# steps kernel by kernel (ncu).
#   run(command="bash tools/gpu-bench/session49a.sh", carry=[".device/dflash.xz"])
set -uo pipefail
T0=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh" dflash
begin_session s49a
smol_model
echo "### model in $((SECONDS - T0)) s"
conc=(bench --model $S/target --device cuda --dtype bf16 --concurrency-modes plain --concurrency-prompt-len 150
  --concurrency-rounds 1 --max-tokens 64)
timeout 120 /tmp/stash/dflash "${conc[@]}" --concurrency 1,64,256 > $R/table.md 2> $R/table.err || { echo "table rc $?"; tail -3 $R/table.err; }
grep -E '^\| (plain|level|mode)' $R/table.md | cut -c1-220
for p in gpu 1; do
  DFLASH_PROFILE=$p timeout 100 /tmp/stash/dflash "${conc[@]}" --concurrency 256 > $R/prof-$p.md 2> $R/prof-$p.err || echo "prof $p rc $?"
  echo "### DFLASH_PROFILE=$p, c = 256: $(batch_step_profile $R/prof-$p.err)"
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  DFLASH_PROFILE=ncu-batch timeout 150 "$NCU" --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/dflash "${conc[@]}" --concurrency 256 \
    > $R/ncu.csv 2> $R/ncu.err || { echo "ncu rc $?"; tail -3 $R/ncu.err; }
  echo "### c = 256: two batch steps, kernels serialized"
  $PY "$here/ncu_summary.py" $R/ncu.csv 2>&1 | { head -16; tail -1; }
fi
echo "### done in $((SECONDS - T0)) s"
