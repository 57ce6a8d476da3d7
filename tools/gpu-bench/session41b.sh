#!/usr/bin/env bash
# Session 41, issue 20's draft bar (draft <= 0.25x the plain step) at the real depth: the
# Qwen3-8B shape of models.py (36 target layers, the 5-layer controlled-acceptance draft, bf16,
# context 128). (1) `bench --micro`, two rounds: verify Q=1 (the plain step) and Q=16, and the
# draft's 16-row proposal, so draft / step is measured, not projected from fewer layers;
# (2) the draft proposal kernel by kernel (`DFLASH_PROFILE=ncu-draft`, ncu, graphs off so each
# launch is its own; two proposals), and the plain step's (`DFLASH_PROFILE=ncu`) beside it.
#   run(command="bash tools/gpu-bench/session41b.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash
begin_session s41b
qwen3_models || exit 1
echo "### models in $((SECONDS - T0)) s"
common=(bench --micro --model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16 --micro-context 128)
for round in 1 2; do
  timeout 120 /tmp/stash/dflash "${common[@]}" --micro-q 1,16 --micro-iters 40 --out "$R/micro-$round" > "$R/micro-$round.log" 2>&1 \
    || { echo "micro rc $?"; tail -3 "$R/micro-$round.log"; }
  echo "### micro round $round (us: median)"
  grep -hE "^\| (verify|draft) forward" "$R/micro-$round/micro.md" | cut -d'|' -f2,5
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for p in ncu-draft ncu; do
  DFLASH_CUDA_GRAPHS=0 DFLASH_PROFILE=$p timeout 150 "$NCU" --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --page raw /tmp/stash/dflash "${common[@]}" --micro-q 1 --micro-iters 2 \
    --out "$R/$p" > "$R/$p.csv" 2> "$R/$p.err" || { echo "ncu $p rc $?"; tail -2 "$R/$p.err"; }
  echo "### $p: kernels of 2 (us; ncu flushes caches before each kernel)"
  $PY "$here/ncu_summary.py" "$R/$p.csv" 2>/dev/null | { head -22; tail -1; }
done
echo "### done in $((SECONDS - T0)) s"
