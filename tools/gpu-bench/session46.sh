#!/usr/bin/env bash
# Session 46: where a draft training step's time goes on the GPU, from a fresh machine (after
# the five GGUF staging calls and stage.sh with .device/dflash.xz): a short greedy pass for data
# (GEN_SECS, 40), then session45.sh's section medians twice (PROFILE=1: wall times after syncs;
# PROFILE=gpu: CUDA events, the kernels' own time: the gap is host time), then Nsight Compute
# over training steps 6 and 7 at the demo's shape (DFLASH_PROFILE=ncu-train): per kernel name,
# launches and GPU microseconds (ncu_summary.py). Env: RUNS, STEPS (as session45.sh).
set -uo pipefail
. "$(dirname "$0")/demo-env.sh"
W=/root/work
mkdir -p "$W/logs"
if [ ! -f "$W/t0/sequences.jsonl" ]; then
  OUT=$W/logs PHASE=gen GEN_SECS=${GEN_SECS:-40} T1_PASSES=0 GEN_BATCH=128 bash tools/gpu-bench/demo-train.sh
fi
export SEQS=$W/t0/sequences.jsonl
export RUNS=${RUNS:-128:16 16:16 512:16 512:64 1024:64}
OUT=$W/logs PROFILE=1 bash tools/gpu-bench/session45.sh
RUNS="128:16 512:64" OUT=$W/logs PROFILE=gpu bash tools/gpu-bench/session45.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "== ncu ($NCU): training steps 6 and 7, batch 128 blocks, 16 a sequence"
DFLASH_PROFILE=ncu-train timeout 300 "$NCU" --profile-from-start off --clock-control none \
  --metrics gpu__time_duration.sum --csv --page raw \
  "$BIN" train --target "$GGUF" --device cuda --max-seq 768 --sequences "$SEQS" \
  --draft-layers 4 --block-size 16 --steps 8 --batch-blocks 128 --blocks-per-seq 16 \
  --lr 6e-4 --warmup 10 --save-every 0 --seed 0 --example-budget-gb 2 --out "$W/prof-ncu" \
  > "$R/ncu-train.csv" 2> "$R/ncu-train.err" || { echo "ncu rc $?"; tail -3 "$R/ncu-train.err"; }
python3 tools/gpu-bench/ncu_summary.py "$R/ncu-train.csv" | head -45
