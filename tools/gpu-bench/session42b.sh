#!/usr/bin/env bash
# Session 42 (issue 23), after `bench --concurrency` moved to continuous admission
# (`Engine::generate_queue`: level c serves max(8, 4c) requests, at most c at once, the next
# admitted as one finishes; level 1 = the first 8 one after another). Qwen3-8B shape,
# controlled-acceptance draft, T = 1, block 8, c = 1 / 8 / 32, plain and DFlash, two rounds;
# the greedy check at c = 8 first.
#   run(command="bash tools/gpu-bench/session42b.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
begin_session s42b
qwen3_models
echo "### models in $((SECONDS - T0)) s"
pair=(--model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16)
conc=(bench "${pair[@]}" --concurrency-prompt-len 128 --block-size 8)
timeout 120 /tmp/stash/dflash "${conc[@]}" --concurrency 8 --max-tokens 64 --concurrency-check > "$R/check.md" 2> "$R/check.err"
echo "### greedy c = 8: $(grep -h greedy "$R/check.md" | tr '\n' ' ')"
for round in 1 2; do
  [ $((SECONDS - T0)) -gt ${TABLE_LIMIT:-420} ] && break
  timeout 200 /tmp/stash/dflash "${conc[@]}" --concurrency 1,8,32 --max-tokens 128 --temperature 1.0 \
    > "$R/table-$round.md" 2> "$R/table-$round.err" || { echo "table rc $?"; tail -3 "$R/table-$round.err"; }
  echo "### round $round ($((SECONDS - T0)) s)"
  grep -E '^\| (plain|dflash)' "$R/table-$round.md" | cut -c1-200
done
grep -h '^switches' "$R/table-1.md"
echo "### done in $((SECONDS - T0)) s"
