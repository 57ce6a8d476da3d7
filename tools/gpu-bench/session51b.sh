#!/usr/bin/env bash
# DFLASH_CUDA_POOL_KEEP settled (sessions 49-50: one round each, default first, read 1.4x for
# the kept pool against session 49's default-pool run of the same part: not conclusive). Plain
# `bench --concurrency 64,256` on a random target of SmolLM2-135M's widths, the two settings
# alternated over ROUNDS rounds (3), the order flipped each round, in one call; then the c =
# 256 verify forward by CUDA events with each. Prints the aggregate tok/s per round last.
#   run(command="bash tools/gpu-bench/session51b.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh" dflash
smol_session s51b
conc=(bench --model $S/target --device cuda --dtype bf16 --concurrency-modes plain --concurrency-prompt-len 150
  --concurrency-rounds 1 --max-tokens 64 --concurrency 64,256)
# a warm-up run first (the first process on a fresh machine was the slow one in session 50)
timeout 100 /tmp/stash/dflash "${conc[@]}" > /dev/null 2>&1
rows=()
for round in $(seq 1 "${ROUNDS:-3}"); do
  order="0 1"; [ $((round % 2)) = 0 ] && order="1 0"
  for keep in $order; do
    [ $((SECONDS - T0)) -gt 480 ] && break 2
    f=$R/r$round-k$keep
    DFLASH_CUDA_POOL_KEEP=$keep timeout 100 /tmp/stash/dflash "${conc[@]}" > $f.md 2> $f.err || { echo "rc $?"; tail -3 $f.err; }
    rows+=("round $round keep $keep: $(grep -E '^\| plain' $f.md | awk -F'|' '{printf "c=%s %s tok/s; ", $3, $5}')")
  done
done
for keep in 0 1; do
  [ $((SECONDS - T0)) -gt 520 ] && break
  DFLASH_CUDA_POOL_KEEP=$keep DFLASH_PROFILE=gpu timeout 100 /tmp/stash/dflash "${conc[@]}" > $R/prof-k$keep.md 2> $R/prof-k$keep.err
  rows+=("keep $keep, c = 256 verify forward by CUDA events: $(grep "profile batch step" $R/prof-k$keep.err | sed 's/.*verify forward \([0-9.]*\).*/\1/' \
    | grep -v profile | tail -63 | sort -n | awk '{a[NR]=$1; s+=$1} END {printf "mean %.2f ms, p50 %.2f", s/NR, a[int(NR/2)]}')")
done
printf '%s\n' "${rows[@]}"
echo "### done in $((SECONDS - T0)) s"
